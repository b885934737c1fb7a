"""SSF, scaling and shifting the features (Lian et al., "Scaling & Shifting Your Features: A New Baseline for
Efficient Model Tuning", NeurIPS 2022), as APER and RanPAC use it (zhoudw-zdw/RevisitingCIL@a2e6b71 and
RanPAC/RanPAC@012927f, ``vision_transformer_ssf.py``: ``init_ssf_scale_shift``, ``ssf_ada``, and their calls in
``Mlp``, ``Attention``, ``Block``, ``PatchEmbed`` and ``VisionTransformer.forward_features``).

A per-channel affine map ``y = gamma ⊙ x + beta`` after each of: the patch embedding's projection, every block's qkv
projection (3d channels), attention output projection, first and second MLP layers (4d and d) and its two LayerNorms,
and the final norm (``norm``, or ``fc_norm`` for an average-pooled ViT). gamma ~ N(1, 0.02^2), beta ~ N(0, 0.02^2): near
(not at) the identity from the start, as in the code. A ViT-B/16 gets 12 · 16,896 + 2 · 1,536 = 205,824 parameters.
"""

from __future__ import annotations

import torch
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from clbench.errors import ConfigError


class SSF(nn.Module):
    """``inner`` followed by a per-channel scale and shift (channels last; dim 1 for a convolution's output); ``inner``
    alone while ``active`` is False."""

    def __init__(self, inner: nn.Module, channels: int, channel_dim: int = -1) -> None:
        super().__init__()
        self.inner = inner
        like = next(inner.parameters())
        self.scale = nn.Parameter(torch.empty(channels, device=like.device, dtype=like.dtype))
        self.shift = nn.Parameter(torch.empty(channels, device=like.device, dtype=like.dtype))
        with torch.no_grad():
            nn.init.normal_(self.scale, mean=1.0, std=0.02)
            nn.init.normal_(self.shift, std=0.02)
        self.channel_dim = channel_dim
        self.active = True

    def forward(self, *args: torch.Tensor, **kwargs: torch.Tensor) -> torch.Tensor:
        y = self.inner(*args, **kwargs)
        if not self.active:
            return y
        if self.channel_dim == 1:
            return y * self.scale.view(1, -1, 1, 1) + self.shift.view(1, -1, 1, 1)
        return y * self.scale + self.shift


def final_norm(vit: VisionTransformer) -> str:
    """The ViT's last norm with parameters: ``norm`` (token pooling) or ``fc_norm`` (average pooling)."""
    for name in ("norm", "fc_norm"):
        if any(True for _ in getattr(vit, name).parameters()):
            return name
    raise ConfigError("Invalid backbone for SSF: the ViT has no final norm with parameters.")


def attach_ssf(vit: VisionTransformer) -> list[SSF]:
    """Wrap every SSF site of ``vit`` (patch embedding, per block qkv, proj, fc1, fc2, norm1, norm2, the final
    norm); returns the wrappers (their ``scale`` and ``shift`` are trainable)."""
    wrapped = []

    def wrap(parent: nn.Module, name: str, channels: int, channel_dim: int = -1) -> None:
        ssf = SSF(getattr(parent, name), channels, channel_dim)
        setattr(parent, name, ssf)
        wrapped.append(ssf)

    d = vit.embed_dim
    wrap(vit.patch_embed, "proj", d, channel_dim=1)
    for i, block in enumerate(vit.blocks):
        if not all(hasattr(block, n) for n in ("norm1", "norm2", "attn", "mlp")) or not hasattr(block.mlp, "fc2"):
            raise ConfigError(f"Invalid backbone for SSF: block {i} is not a timm Block with an Mlp.")
        wrap(block.attn, "qkv", block.attn.qkv.out_features)
        wrap(block.attn, "proj", d)
        wrap(block.mlp, "fc1", block.mlp.fc1.out_features)
        wrap(block.mlp, "fc2", d)
        wrap(block, "norm1", d)
        wrap(block, "norm2", d)
    wrap(vit, final_norm(vit), d)
    return wrapped
