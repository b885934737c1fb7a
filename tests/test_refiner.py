"""Refiner attention: identity at initialisation, token masks respected, and every method runs on it."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from clbench.backbones import build_backbone
from clbench.backbones.refiner import RefinerAttention, add_refiner
from clbench.loop import train
from clbench.methods.token_masking import key_masked_attention
from conftest import tiny_config


def micro_vit() -> torch.nn.Module:
    torch.manual_seed(0)
    return build_backbone(tiny_config("backbone.kwargs.depth=2").backbone).eval()


def test_refiner_at_init_equals_the_wrapped_vit() -> None:
    vit = micro_vit()
    refined = copy.deepcopy(vit)
    add_refiner(refined, expand_ratio=3, kernel_size=3)
    assert all(isinstance(b.attn, RefinerAttention) for b in refined.blocks)
    x = torch.randn(4, 3, 16, 16)
    with torch.no_grad():
        assert torch.allclose(refined.forward_features(x), vit.forward_features(x), atol=1e-5)
    # the refinement is live: once its last scale is nonzero the output changes
    torch.nn.init.ones_(refined.blocks[0].attn.refine[-1].weight)
    with torch.no_grad():
        assert not torch.allclose(refined.forward_features(x), vit.forward_features(x), atol=1e-3)


def test_refiner_attention_respects_a_key_mask() -> None:
    torch.manual_seed(0)
    attn = RefinerAttention(micro_vit().blocks[0].attn).eval()
    x = torch.randn(2, 5, attn.attn_dim)
    keep = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0])
    with torch.no_grad():
        q, k, v = attn.qkv(x).reshape(2, 5, 3, attn.num_heads, attn.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        expected = attn.proj(key_masked_attention(q, k, v, keep).transpose(1, 2).reshape(2, 5, attn.attn_dim))
        assert torch.allclose(attn(x, keep=keep), expected, atol=1e-5)
        torch.nn.init.ones_(attn.refine[-1].weight)  # a live refinement mixes neighbouring map entries...
        seen: list[torch.Tensor] = []
        attn.attn_drop = Recorder(seen)  # the final maps pass through attn_drop just before weighting the values
        attn(x, keep=keep)
    assert (seen[0][..., keep == 0] == 0).all()  # ...but removed keys still get no weight
    assert (seen[0][..., keep == 1] != 0).any()


class Recorder(torch.nn.Module):
    def __init__(self, store: list[torch.Tensor]) -> None:
        super().__init__()
        self.store = store

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.store.append(x)
        return x


# DualPrompt and CODA-Prompt attach prefixes to timm's attention: Refiner attention is refused for them (tested there)
@pytest.mark.parametrize("method", ["finetune", "joint", "packnet", "piggyback", "supsup", "hat", "meat", "l2p"])
def test_every_method_runs_on_refiner(tmp_path: Path, method: str) -> None:
    extra = ("trainer.lr_scale_batch=null", "trainer.warmup_epochs=0") if method == "meat" else ()
    cfg = tiny_config("backbone=vit_micro_refiner", f"method={method}", "data.num_tasks=2", "trainer.epochs=1", *extra)
    results = train(cfg, tmp_path)
    assert results.status == "finished" and results.header["backbone_config"]["refiner"] is True


def test_refiner_key_mask_survives_a_dominant_masked_key() -> None:
    """Eq. 5 through Refiner's explicit maps when a masked key's logit leads every kept one by ~1000: the softmax is
    shifted by the row maximum over the kept keys, so the maps and their gradients stay finite (a shift by the
    maximum over all keys gave 0/0), and per-image masks (B, N) give each image its own map."""
    attn = micro_vit().blocks[0].attn
    refiner = RefinerAttention(attn)
    x = torch.randn(2, 17, attn.qkv.in_features)
    with torch.no_grad():
        refiner.qkv.weight.mul_(40.0)  # huge logits
    keep = torch.ones(2, 17)
    keep[:, 3:9] = 0
    keep.requires_grad_(True)
    out = refiner(x, keep=keep)
    out.square().sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(keep.grad).all()
    with torch.no_grad():  # the first image alone, with a 1-D mask: the same rows
        assert torch.allclose(refiner(x[:1], keep=keep[0].detach()), out[:1], atol=1e-4)
