"""The parameter-efficient parts (clbench.methods.parts: AdaptFormer adapters, SSF, deep and shallow VPT) against an
independent transcription of APER's and RanPAC's official modules (tests/oracles/petl_reference.py), on a tiny ViT
with non-trivial parameters: the same features to fp32 rounding. And what both codes rely on: an adapter at its
initialisation leaves the pretrained ViT exact, switched off every part gives the pretrained ViT bit for bit, only
the new parameters train, the parameter counts of ViT-B/16, attention stays fused."""

from __future__ import annotations

import pytest
import timm
import torch
from timm.models.vision_transformer import VisionTransformer

from clbench.errors import ConfigError
from clbench.methods.first_session import vit_features
from clbench.methods.parts import petl
from clbench.methods.parts.adaptformer import AdaptFormer, attach_adaptformer
from clbench.methods.parts.bottleneck import Bottleneck, dropout_mask
from clbench.methods.parts.ssf import attach_ssf
from clbench.methods.parts.vpt import attach_vpt
from conftest import attention_ops
from oracles import petl_reference as ref

SHAPE = {"depth": 2, "heads": 2, "patch": 4}


def tiny_vit(avg: bool = False, seed: int = 0) -> VisionTransformer:
    torch.manual_seed(seed)
    vit = timm.create_model(
        "vit_tiny_patch16_224",
        pretrained=False,
        num_classes=0,
        img_size=16,
        patch_size=4,
        embed_dim=32,
        depth=2,
        num_heads=2,
        global_pool="avg" if avg else "token",
    )
    with torch.no_grad():  # timm zeroes the class token and biases: give every weight a value that matters
        for p in vit.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return vit.eval()


def weights(vit: VisionTransformer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in vit.state_dict().items()}


def randomise(params: list[torch.nn.Parameter], scale: float = 0.3) -> None:
    """Move every parameter by N(0, scale^2) noise: away from any initialisation that hides a term."""
    with torch.no_grad():
        for p in params:
            p.add_(scale * torch.randn_like(p))


IMAGES = torch.randn(3, 3, 16, 16, generator=torch.Generator().manual_seed(1))


def test_the_adapter_is_the_official_parallel_adaptformer() -> None:
    vit = tiny_vit()
    w = weights(vit)
    wrapped = attach_adaptformer(vit, bottleneck=8, scale=0.1, dropout=0.1)
    vit.eval()  # no dropout
    randomise([p for m in wrapped for p in m.adapter.parameters()])
    adapters = [{**{k: v.detach() for k, v in m.adapter.state_dict().items()}, "scale": 0.1} for m in wrapped]
    expected = ref.features(IMAGES, w, **SHAPE, adapters=adapters)
    torch.testing.assert_close(vit_features(vit, IMAGES), expected, rtol=1e-5, atol=1e-5)


def test_an_adapter_at_its_initialisation_and_any_part_switched_off_is_the_pretrained_vit_bit_for_bit() -> None:
    """W_up = 0 and zero biases: the adapted ViT's output is the pretrained one's, exactly (the codes' reason for
    the init); every part switched off is exactly the ViT before it was attached."""
    pretrained = vit_features(tiny_vit(), IMAGES)
    vit = tiny_vit()
    attach_adaptformer(vit)
    assert torch.equal(vit_features(vit, IMAGES), pretrained)
    for kind in petl.KINDS:
        for avg in (False, True):
            vit, plain = tiny_vit(avg), tiny_vit(avg)
            handle = petl.attach(vit, kind, bottleneck=8, tokens=3)
            randomise(handle.parameters())
            assert not torch.equal(vit_features(vit, IMAGES), vit_features(plain, IMAGES)), kind
            with handle.off():
                assert torch.equal(vit_features(vit, IMAGES), vit_features(plain, IMAGES)), kind
            assert handle.active


def test_adapter_initialisation_and_dropout_follow_the_code() -> None:
    """Kaiming-uniform(a = sqrt 5) down (bound 1/sqrt(d) for fan-in d), zero up and biases; dropout 0.1 on the
    bottleneck in training only."""
    torch.manual_seed(0)
    adapter = AdaptFormer(768, 64, 0.1, 0.1)
    bound = 1 / 768**0.5
    assert adapter.down.weight.abs().max() <= bound and adapter.down.weight.abs().max() > 0.99 * bound
    assert not adapter.up.weight.any() and not adapter.up.bias.any() and not adapter.down.bias.any()
    torch.nn.init.normal_(adapter.up.weight)
    x = torch.randn(4, 768)
    adapter.eval()
    assert torch.equal(adapter(x), adapter(x))
    adapter.train()
    assert not torch.equal(adapter(x), adapter(x))
    manual = 0.1 * (torch.relu(x @ adapter.down.weight.T + adapter.down.bias) @ adapter.up.weight.T + adapter.up.bias)
    torch.testing.assert_close(adapter.eval()(x), manual)


def test_dropout_is_drawn_for_the_whole_batch_and_each_rank_keeps_its_rows() -> None:
    """Two ranks seeded alike, each with its share of a batch of 5 (rows 0-2, 3-4), train through the masks one
    process draws for the batch: the shares' outputs are the rows of the whole batch's. Inverted dropout: a kept unit
    is scaled by 1 / (1 - p), about 1 - p of them are kept."""
    torch.manual_seed(0)
    adapter = AdaptFormer(16, 64, 1.0, 0.5).train()
    torch.nn.init.normal_(adapter.up.weight)
    x = torch.randn(5, 3, 16)
    torch.manual_seed(1)
    whole = adapter(x)
    shares = []
    for part in (slice(0, 3), slice(3, 5)):
        adapter.share = (5, part)
        torch.manual_seed(1)
        shares.append(adapter(x[part]))
    torch.testing.assert_close(torch.cat(shares), whole)
    adapter.share = (5, slice(0, 3))  # another batch than the share (a method's extra forward): drawn for itself
    torch.manual_seed(1)
    assert adapter(x[:2]).shape == (2, 3, 16)
    mask = dropout_mask(torch.ones(1000, 64), 0.25, None)
    assert mask.unique().tolist() == [0.0, torch.tensor(1 / 0.75).item()]
    assert abs((mask > 0).float().mean().item() - 0.75) < 0.01


def test_houlsbys_adapter_and_adaptformer_share_the_bottleneck() -> None:
    from clbench.methods.adapter import HoulsbyAdapter

    assert issubclass(HoulsbyAdapter, Bottleneck) and issubclass(AdaptFormer, Bottleneck)


def test_an_adapter_refuses_a_block_with_layer_scale() -> None:
    vit = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=0, img_size=16, patch_size=4,
                            embed_dim=32, depth=1, num_heads=2, init_values=1e-5)  # fmt: skip
    with pytest.raises(ConfigError, match="layer scale"):
        attach_adaptformer(vit)


@pytest.mark.parametrize("avg", [False, True], ids=["token", "avg"])
def test_ssf_is_the_officials_scale_and_shift_at_each_of_its_sites(avg: bool) -> None:
    vit = tiny_vit(avg)
    w = weights(vit)
    wrapped = attach_ssf(vit)
    for m in wrapped:
        with torch.no_grad():
            m.scale.normal_(1.0, 0.3)
            m.shift.normal_(0.0, 0.3)
    final = vit.fc_norm if avg else vit.norm
    sites = {"patch": vit.patch_embed.proj, "final": final}
    for i, b in enumerate(vit.blocks):
        sites |= {f"{i}.qkv": b.attn.qkv, f"{i}.proj": b.attn.proj, f"{i}.fc1": b.mlp.fc1, f"{i}.fc2": b.mlp.fc2}
        sites |= {f"{i}.norm1": b.norm1, f"{i}.norm2": b.norm2}
    assert {id(s) for s in sites.values()} == {id(m) for m in wrapped}  # every site, nothing else

    def ssf(site: str, x: torch.Tensor) -> torch.Tensor:
        return ref.ssf_ada(x, sites[site].scale.detach(), sites[site].shift.detach())

    expected = ref.features(IMAGES, w, **SHAPE, avg=avg, ssf=ssf)
    torch.testing.assert_close(vit_features(vit, IMAGES), expected, rtol=1e-5, atol=1e-5)


def test_ssf_starts_near_the_identity_as_the_code_draws_it() -> None:
    """gamma ~ N(1, 0.02^2), beta ~ N(0, 0.02^2) (init_ssf_scale_shift): over ViT-B/16's 102,912 of each, the sample
    mean and std within 5 standard errors."""
    torch.manual_seed(0)
    vit = timm.create_model("vit_base_patch16_224", pretrained=False, num_classes=0)
    wrapped = attach_ssf(vit)
    scale = torch.cat([m.scale.detach() for m in wrapped])
    shift = torch.cat([m.shift.detach() for m in wrapped])
    n = len(scale)
    assert n == ref.ssf_params(768, 3072, 12) // 2 == 102_912
    for values, mean in ((scale, 1.0), (shift, 0.0)):
        assert abs(float(values.mean()) - mean) < 5 * 0.02 / n**0.5
        assert abs(float(values.std()) - 0.02) < 5 * 0.02 / (2 * n) ** 0.5


@pytest.mark.parametrize("deep", [True, False], ids=["deep", "shallow"])
def test_vpt_is_the_officials_prompt_tokens(deep: bool) -> None:
    vit = tiny_vit()
    w = weights(vit)
    wrapped = attach_vpt(vit, tokens=3, deep=deep)
    params = [m.prompts for m in wrapped if m.prompts is not None]
    assert len(params) == (2 if deep else 1)
    assert all(not p.any() for p in params)  # zeros, as both codes
    randomise(params)
    expected = ref.features(IMAGES, w, **SHAPE, prompts=[p.detach()[0] for p in params], deep=deep)
    torch.testing.assert_close(vit_features(vit, IMAGES), expected, rtol=1e-5, atol=1e-5)
    tokens = vit.forward_features(IMAGES)
    assert tokens.shape[1] == 1 + 16  # the prompts are gone before the final norm


def test_vit_b16_counts_as_the_codes_print_them() -> None:
    """AdaptFormer r = 64: 99,136 per block, 1,189,632 in all; SSF: 205,824; VPT-deep, 5 tokens: 46,080."""
    counts = {}
    for kind in petl.KINDS:
        with torch.device("meta"):
            vit = timm.create_model("vit_base_patch16_224", pretrained=False, num_classes=0)
            counts[kind] = petl.attach(vit, kind).numel()
    assert ref.adapter_params(768, 64) == 99_136
    assert counts == {
        "adapter": 12 * 99_136,
        "ssf": ref.ssf_params(768, 3072, 12),
        "vpt_deep": 12 * 5 * 768,
        "vpt_shallow": 5 * 768,
    }
    assert counts["ssf"] == 205_824


def test_only_the_new_parameters_train_and_the_vits_own_keep_their_flag() -> None:
    for kind in petl.KINDS:
        vit = tiny_vit().requires_grad_(False)
        own = {id(p) for p in vit.parameters()}
        handle = petl.attach(vit, kind, bottleneck=8, tokens=3)
        assert all(p.requires_grad for p in handle.parameters())
        assert {id(p) for p in vit.parameters() if p.requires_grad} == {id(p) for p in handle.parameters()}
        assert not own & {id(p) for p in handle.parameters()}
        assert handle.state("petl.").keys() == {f"petl.{name}" for name in handle.named}


def test_attention_stays_fused_under_every_part() -> None:
    for kind in petl.KINDS:
        vit = tiny_vit()
        petl.attach(vit, kind, bottleneck=8, tokens=3)
        fused, softmax = attention_ops(lambda vit=vit: vit_features(vit, IMAGES))
        assert fused and not softmax, (kind, softmax)
