"""Refiner attention (Zhou et al., "Refiner: Refining Self-attention for Vision Transformers", arXiv 2106.03714).

A drop-in replacement for a timm ``Attention`` that refines the attention maps before they weight the values:
attention expansion (a 1x1 convolution over the H heads to ``expand_ratio`` x H maps), distributed local
attention (a depthwise k x k convolution on each N x N map, "same" padding), and a linear reduction back to H
maps, each followed by a normalisation (and ReLU6 after the first two); the refined maps are added to the
softmax maps (identity residual).

clbench's choices (not the paper's released models, which also share attention across blocks and use a CNN
stem; flagged as non-paper): the module adopts a pretrained ViT's q/k/v and projection, and the last
normalisation's scale starts at 0, so at initialisation the block computes exactly the wrapped ViT's
attention and pretrained weights stay usable. The normalisations are per-channel affine maps (BatchNorm
without running statistics): with batch statistics a prediction would depend on its batch, and running
statistics would drift while old tasks are meant to be frozen. They are ordinary backbone parameters, so
methods that freeze the backbone (Piggyback, SupSup, MEAT) freeze them with it and PackNet/HAT train them
with the first task only; nothing is kept per task.

MEAT's token masks: with a keep-mask the softmax runs over the kept keys (Eq. 5, differentiable in the mask)
and the refined maps are multiplied by the mask again, so the convolutions cannot move attention back onto a
removed token.
"""

from __future__ import annotations

import torch
from torch import nn

MAX_SCALE = 30.0  # the largest exponent a masked key's weight may take in a mask gradient (finite, also squared)


class ChannelAffine(nn.Module):
    """y = weight * x + bias per channel of a (B, C, H, W) tensor."""

    def __init__(self, channels: int, weight: float = 1.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.full((channels,), weight))
        self.bias = nn.Parameter(torch.zeros(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight.view(1, -1, 1, 1) + self.bias.view(1, -1, 1, 1)


class RefinerAttention(nn.Module):
    """Adopts a timm ``Attention``'s submodules (``qkv``, ``proj``, norms, dropouts) and adds the refinement."""

    def __init__(self, attn: nn.Module, expand_ratio: int = 3, kernel_size: int = 3) -> None:
        super().__init__()
        if getattr(attn, "gate", None) is not None:
            raise ValueError("Refiner attention does not support timm's gated attention")
        for name in ("num_heads", "head_dim", "attn_dim", "scale"):
            setattr(self, name, getattr(attn, name))
        self.qkv, self.q_norm, self.k_norm = attn.qkv, attn.q_norm, attn.k_norm
        self.attn_drop, self.norm, self.proj, self.proj_drop = attn.attn_drop, attn.norm, attn.proj, attn.proj_drop
        heads, wide = self.num_heads, self.num_heads * expand_ratio
        self.refine = nn.Sequential(
            nn.Conv2d(heads, wide, 1),  # attention expansion
            ChannelAffine(wide),
            nn.ReLU6(),
            nn.Conv2d(wide, wide, kernel_size, padding=kernel_size // 2, groups=wide),  # distributed local attention
            ChannelAffine(wide),
            nn.ReLU6(),
            nn.Conv2d(wide, heads, 1),  # linear reduction
            ChannelAffine(heads, weight=0.0),  # starts at 0: the block is the wrapped attention at init
        )

    def forward(
        self,
        x: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        is_causal: bool = False,
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``keep`` (N,) or (B, N): MEAT's key mask over all N tokens (prefix tokens included)."""
        if is_causal:
            raise ValueError("Refiner attention is not causal")
        b, n, _ = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        q, k = self.q_norm(q), self.k_norm(k)
        scores = (q * self.scale) @ k.transpose(-2, -1)
        if attn_mask is not None:
            scores = scores + attn_mask
        if keep is None:
            attn = scores.softmax(dim=-1)
        else:  # Eq. 5, shifted by the row maximum over the kept keys: no 0/0 whatever the masked keys' logits
            keep = keep.to(scores.dtype).reshape(-1, 1, 1, keep.shape[-1])
            top = scores.detach().masked_fill(keep == 0, float("-inf")).amax(-1, keepdim=True)
            weights = (scores - top).clamp_max(MAX_SCALE).exp() * keep  # a masked key's gradient stays finite
            attn = weights / weights.sum(-1, keepdim=True)
        attn = attn + self.refine(attn)
        if keep is not None:
            attn = attn * keep
        out = (self.attn_drop(attn) @ v).transpose(1, 2).reshape(b, n, self.attn_dim)
        return self.proj_drop(self.proj(self.norm(out)))


def add_refiner(model: nn.Module, expand_ratio: int, kernel_size: int) -> None:
    """Replace the attention of every block of a timm ViT by :class:`RefinerAttention`."""
    for block in model.blocks:
        block.attn = RefinerAttention(block.attn, expand_ratio, kernel_size)
