"""Backbones: timm ViTs built headless; local weights load offline; missing or corrupt weights are clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from clbench.backbones import build_backbone, input_stats
from clbench.config import BackboneConfig
from clbench.errors import ConfigError, WeightsError

MICRO = dict(patch_size=4, embed_dim=32, depth=1, num_heads=2)


def micro(**kw) -> BackboneConfig:
    return BackboneConfig(name="vit_micro", model="vit_tiny_patch16_224", img_size=16, kwargs=dict(MICRO), **kw)


def test_micro_vit_is_headless() -> None:
    model = build_backbone(micro())
    feats = model.forward_head(model.forward_features(torch.zeros(2, 3, 16, 16)), pre_logits=True)
    assert feats.shape == (2, 32) and model.num_classes == 0


@pytest.mark.parametrize("suffix", [".safetensors", ".pth"])
def test_local_weights_load_without_network(tmp_path: Path, suffix: str) -> None:
    source = build_backbone(micro())
    path = tmp_path / f"weights{suffix}"
    state = {k: v.contiguous() for k, v in source.state_dict().items()}
    save_file(state, str(path)) if suffix == ".safetensors" else torch.save(state, path)
    loaded = build_backbone(micro(weights=str(path)))
    for key, value in source.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key


def test_missing_weights_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(WeightsError, match="does not exist"):
        build_backbone(micro(weights=str(tmp_path / "absent.safetensors")))


def test_corrupt_weights_file_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "broken.safetensors"
    path.write_bytes(b"not a safetensors file")
    with pytest.raises(WeightsError, match=r"broken\.safetensors"):
        build_backbone(micro(weights=str(path)))


def test_pretrained_offline_without_cache_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))  # an empty cache
    cfg = BackboneConfig(name="deit_tiny_patch16_224", model="deit_tiny_patch16_224", tag="fb_in1k", pretrained=True)
    with pytest.raises(WeightsError, match=r"deit_tiny_patch16_224\.fb_in1k.*backbone\.weights=PATH"):
        build_backbone(cfg)


def test_unknown_or_non_vit_models_are_rejected() -> None:
    with pytest.raises(ConfigError, match="not a timm model"):
        build_backbone(BackboneConfig(name="x", model="vit_imaginary_patch3"))
    with pytest.raises(ConfigError, match="not a plain Vision Transformer"):
        build_backbone(BackboneConfig(name="r", model="resnet18", img_size=32))


def test_input_stats_follow_the_weights_or_identity() -> None:
    model = build_backbone(micro())
    assert input_stats(model, micro()) == ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
    assert input_stats(model, micro(normalize=False)) == ((0.0, 0.0, 0.0), (1.0, 1.0, 1.0))
