"""MEAT: token masks as key masks in fused attention, Gumbel masks, the drop-control loss, exact zero forgetting."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from clbench.errors import ConfigError
from clbench.loop.runtime import build_runtime
from clbench.methods.meat import MEAT, drop_control_loss, hard_gumbel_keep
from clbench.methods.token_masking import key_masked_attention
from conftest import tiny_config

MEAT_TINY = ("method=meat", "trainer.lr_scale_batch=null", "trainer.warmup_epochs=0", "trainer.batch_size=16")


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Eq. 5 written out: Psi_ij = m_j exp(A_ij) / sum_s m_s exp(A_is)."""
    scores = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
    weights = keep * (scores - scores.amax(-1, keepdim=True)).exp()
    return (weights / weights.sum(-1, keepdim=True)) @ v


def test_both_attention_paths_equal_the_reference_masked_softmax() -> None:
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 7, 8, dtype=torch.float64) for _ in range(3))
    keep = torch.tensor([1.0, 0, 1, 1, 0, 0, 1], dtype=torch.float64)  # token 0 = CLS, kept
    expected = reference_attention(q, k, v, keep)
    assert torch.allclose(key_masked_attention(q, k, v, keep), expected)  # additive-bias path
    keep_grad = keep.clone().requires_grad_(True)
    out = key_masked_attention(q, k, v, keep_grad)  # value-extension path, differentiable in the mask
    assert torch.allclose(out, expected)
    upstream = torch.randn_like(out)
    (out * upstream).sum().backward()
    ref_keep = keep.clone().requires_grad_(True)
    (reference_attention(q, k, v, ref_keep) * upstream).sum().backward()
    assert torch.allclose(keep_grad.grad, ref_keep.grad)
    assert (keep_grad.grad[keep == 0] != 0).all()  # masked tokens get a gradient too


@pytest.mark.parametrize("head_dim", [16, 32, 64])
def test_the_differentiable_path_gives_sdpa_widths_its_fused_cuda_kernels_accept(
    head_dim: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Flash attention needs equal q/k/v widths, multiples of 8; the value width head_dim + 1 alone would send MEAT's
    training attention to the unfused math kernel."""
    seen: list[tuple[int, int, int]] = []
    sdpa = F.scaled_dot_product_attention

    def spy(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: object) -> torch.Tensor:
        seen.append((q.shape[-1], k.shape[-1], v.shape[-1]))
        return sdpa(q, k, v, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    q, k, v = (torch.randn(2, 3, 7, head_dim, dtype=torch.float64) for _ in range(3))
    keep = torch.tensor([1.0, 0, 1, 1, 0, 0, 1], dtype=torch.float64, requires_grad=True)
    out = key_masked_attention(q, k, v, keep)
    (dq, dk, dv) = seen[-1]
    assert dq == dk == dv and dv % 8 == 0 and dv > head_dim
    assert torch.allclose(out, reference_attention(q, k, v, keep.detach()))


def test_drop_control_loss_on_constructed_masks() -> None:
    nine_of_ten = torch.tensor([1.0] * 9 + [0.0])
    half = torch.tensor([1.0] * 5 + [0.0] * 5)
    assert drop_control_loss([nine_of_ten], 0.9).item() == pytest.approx(0.0)
    assert drop_control_loss([nine_of_ten, half], 0.9).item() == pytest.approx((0.0 + 0.4**2) / 2)


def test_keep_init_with_every_mask_on_equals_the_frozen_backbone() -> None:
    method, rt = build_runtime(tiny_config(*MEAT_TINY, "method.init=keep"))
    assert isinstance(method, MEAT)
    method.before_task(rt.benchmark.tasks[0])
    method.eval()
    x = rt.test_tf(rt.benchmark.test[0].x[:8])
    with torch.no_grad():
        plain = method.backbone.forward_head(method.backbone.forward_features(x), pre_logits=True)  # no mask set
        masked = method.features(x, 0)
    assert all(bool(method.token_mask(i, 0).all()) for i in method.attentions)
    assert torch.allclose(masked, plain, atol=1e-5)


def test_no_gumbel_noise_at_evaluation() -> None:
    method, rt = build_runtime(tiny_config(*MEAT_TINY, "method.init=uniform"))  # logits near 0: samples would vary
    method.before_task(rt.benchmark.tasks[0])
    x = rt.test_tf(rt.benchmark.test[0].x[:8])
    method.eval()
    first, second = method.predict(x, 0), method.predict(x, 0)
    assert torch.equal(first, second)
    logits = method.scores["token_0"]
    assert torch.equal(method.token_mask(0, 0), (logits[:, 0] > logits[:, 1]).float())
    method.train()
    samples = torch.stack([method.token_mask(0, 0) for _ in range(20)])
    assert not (samples == samples[0]).all()  # training samples vary (uniform init: many uncertain entries)


def test_bad_token_mask_layers_are_rejected() -> None:
    with pytest.raises(ConfigError, match=r"token_mask_layers.*0\.\.0"):
        build_runtime(tiny_config(*MEAT_TINY, "method.token_mask_layers=[3]"))
    with pytest.raises(ConfigError, match=r"method\.lam"):
        tiny_config(*MEAT_TINY, "method.lam=1.5")


def test_storage_counts_ffn_and_token_masks_per_task() -> None:
    """(Exact zero forgetting is tested with the other mask methods in test_masks.py.)"""
    method, rt = build_runtime(tiny_config(*MEAT_TINY, "method.token_mask_layers=[0]"))
    for task in rt.benchmark.tasks:
        method.before_task(task)
        method.after_task(task)
    fc_weights = sum(b.mlp.fc1.weight.numel() + b.mlp.fc2.weight.numel() for b in method.backbone.blocks)
    patches = method.backbone.patch_embed.num_patches
    for entry in method.storage()["bits_per_task"]:
        assert entry["ffn_masks"] == fc_weights and entry["token_masks"] == patches
        assert entry["head"] == 32 * (method.backbone.num_features * 2 + 2)


def test_the_two_way_gumbel_sampler_matches_gumbel_softmax() -> None:
    """hard_gumbel_keep is F.gumbel_softmax(hard=True)[..., 0] for two categories, with half the noise."""
    torch.manual_seed(0)
    logits = torch.tensor([[2.0, 0.0], [-1.0, 0.5]]).repeat(100_000, 1)
    keep = hard_gumbel_keep(logits, tau=0.5)
    assert set(keep.unique().tolist()) <= {0.0, 1.0}
    expected = torch.sigmoid(logits[:2, 0] - logits[:2, 1])  # P(keep) of a Gumbel-max sample, for any tau
    assert torch.allclose(keep.view(-1, 2).mean(0), expected, atol=0.01)
    reference = F.gumbel_softmax(logits, tau=0.5, hard=True)[:, 0].view(-1, 2).mean(0)
    assert torch.allclose(reference, expected, atol=0.01)
    # straight-through gradient: that of the soft two-way softmax, sigmoid((l0 - l1 + noise) / tau)
    one = torch.tensor([[0.3, -0.2]], requires_grad=True)
    torch.manual_seed(1)
    hard_gumbel_keep(one, tau=0.5).sum().backward()
    torch.manual_seed(1)
    u = torch.rand(1)
    soft = torch.sigmoid((0.5 + torch.log(u) - torch.log1p(-u)) / 0.5)
    slope = (soft * (1 - soft) / 0.5).item()
    assert torch.allclose(one.grad, torch.tensor([[slope, -slope]]))


def test_token_masks_are_drawn_per_image_and_ffn_masks_per_forward() -> None:
    """The official code's Gumbel noise: each image of a batch gets its own token-mask sample (one draw for the whole
    batch would multiply the mask gradient's variance by the batch size); an FFN mask is one draw per forward."""
    method, rt = build_runtime(tiny_config(*MEAT_TINY, "method.init=uniform"))  # logits near 0
    task = rt.benchmark.tasks[0]
    method.before_task(task)
    method.train()
    layer = next(iter(method.attentions))
    masks = method.token_mask(layer, task.id, batch=16)
    assert masks.shape == (16, method.num_tokens)
    assert len({tuple(row.tolist()) for row in masks}) > 1  # init=uniform: images disagree on some token
    name = next(iter(method.layers))
    assert method.mask_for(name, task.id).shape == method.layers[name].weight.shape


def test_a_rank_takes_its_rows_of_the_whole_batch_draw() -> None:
    """Under torchrun each rank trains on its share of the batch: its token masks are its rows of the draw one process
    makes for the whole batch (so 2 processes reproduce 1)."""
    method, rt = build_runtime(tiny_config(*MEAT_TINY))
    task = rt.benchmark.tasks[0]
    method.before_task(task)
    method.train()
    seen: list[torch.Tensor] = []
    attn = next(iter(method.attentions.values()))
    forward = attn.forward

    def spy(x: torch.Tensor, **kwargs: object) -> torch.Tensor:
        seen.append(attn.keep.detach().clone())
        return forward(x, **kwargs)

    attn.forward = spy
    x = rt.test_tf(rt.benchmark.train[0].x[:6])
    y = rt.benchmark.train[0].y[:6]
    torch.manual_seed(3)
    method.batch_share = (6, slice(None))
    method.training_loss(x, y, task)
    torch.manual_seed(3)
    method.batch_share = (6, slice(2, 5))
    method.training_loss(x[2:5], y[2:5], task)
    assert torch.equal(seen[1], seen[0][2:5])
