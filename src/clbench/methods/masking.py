"""The masked-weight mechanism shared by every weight-mask method (PackNet, Piggyback, SupSup, MEAT's FFN masks).

:func:`wrap_layers` swaps the chosen layers of a timm ViT (``attn.qkv``, ``attn.proj``, ``mlp.fc1``,
``mlp.fc2`` by default; optionally the patch embedding's ``patch_embed.proj`` Conv2d) for
:class:`MaskedLinear` / :class:`MaskedConv2d`, which compute the layer with ``W * m`` instead of ``W``, with
``m`` set by the method before each forward (one tensor per layer: no Python work per weight).
A mask may carry gradients (straight-through scores) or be a stored binary mask.

Binary masks are stored packed, 8 weights per byte (:func:`pack_bits` / :func:`unpack_bits`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

DEFAULT_TARGETS = ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2")
MASKABLE = (*DEFAULT_TARGETS, "patch_embed.proj")


class MaskedLayer(nn.Module):
    """Mixin for a weight layer whose weight is multiplied by ``self.mask`` (when set) in the forward pass.

    ``superposed`` (shape (T, *weight.shape)) with ``alpha`` (shape (B, T)) computes, per sample b,
    ``sum_t alpha[b, t] * layer(x_b; W * superposed[t]) + bias`` (SupSup's superposition of masks, with
    per-sample coefficients so that no sample's prediction depends on another's).
    """

    weight: nn.Parameter
    bias: nn.Parameter | None

    def _init_masks(self) -> None:
        self.mask: torch.Tensor | None = None
        self.superposed: torch.Tensor | None = None
        self.alpha: torch.Tensor | None = None

    @property
    def fan_in(self) -> int:
        return self.weight[0].numel()

    def apply_weight(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The layer's own operation with the given (masked) weight."""
        raise NotImplementedError

    def bias_view(self, bias: torch.Tensor) -> torch.Tensor:
        """``bias`` shaped to broadcast over the layer's output."""
        return bias

    def superposed_term(self, x: torch.Tensor, mask: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
        """alpha[b] * layer(x_b; W * mask) for every sample b (one task's share of the superposition)."""
        out = self.apply_weight(x, self.weight * mask.to(self.weight.dtype), None)
        return alpha.to(out.dtype).view(-1, *([1] * (out.dim() - 1))) * out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.superposed is not None and self.alpha is not None:
            # Summed task by task under activation checkpointing: backward recomputes each task's output instead of
            # keeping T of them (B x T x N x out), so memory does not grow with the number of tasks.
            out = sum(
                checkpoint(self.superposed_term, x, m, self.alpha[:, t], use_reentrant=False)
                for t, m in enumerate(self.superposed)
            )
            return out if self.bias is None else out + self.bias_view(self.bias)
        weight = self.weight if self.mask is None else self.weight * self.mask.to(self.weight.dtype)
        return self.apply_weight(x, weight, self.bias)


class MaskedLinear(MaskedLayer, nn.Linear):
    """An ``nn.Linear`` (sharing the original's parameters) with a weight mask."""

    def __init__(self, linear: nn.Linear) -> None:
        nn.Linear.__init__(self, linear.in_features, linear.out_features, bias=linear.bias is not None)
        self.weight, self.bias = linear.weight, linear.bias
        self._init_masks()

    def apply_weight(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, weight, bias)


class MaskedConv2d(MaskedLayer, nn.Conv2d):
    """An ``nn.Conv2d`` (sharing the original's parameters) with a weight mask: the ViT's patch embedding."""

    def __init__(self, conv: nn.Conv2d) -> None:
        nn.Conv2d.__init__(
            self,
            conv.in_channels,
            conv.out_channels,
            conv.kernel_size,  # type: ignore[arg-type]
            stride=conv.stride,  # type: ignore[arg-type]
            padding=conv.padding,  # type: ignore[arg-type]
            dilation=conv.dilation,  # type: ignore[arg-type]
            groups=conv.groups,
            bias=conv.bias is not None,
            padding_mode=conv.padding_mode,
        )
        self.weight, self.bias = conv.weight, conv.bias
        self._init_masks()

    def apply_weight(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self._conv_forward(x, weight, bias)

    def bias_view(self, bias: torch.Tensor) -> torch.Tensor:
        return bias[:, None, None]


def wrap_layers(model: nn.Module, targets: tuple[str, ...] = DEFAULT_TARGETS) -> dict[str, MaskedLayer]:
    """Replace every Linear (or Conv2d: ``patch_embed.proj``) whose qualified name ends in one of ``targets``
    by its masked version; returns them by name. Raises ValueError for an empty ``targets`` (nothing to mask: the
    method would train only its heads) or a target no layer matches."""
    if not targets:
        raise ValueError("an empty list masks nothing")
    wrapped: dict[str, MaskedLayer] = {}
    for name, module in list(model.named_modules()):
        if isinstance(module, MaskedLayer) or not name.endswith(targets):
            continue
        if isinstance(module, nn.Linear):
            layer: MaskedLayer = MaskedLinear(module)
        elif isinstance(module, nn.Conv2d):
            layer = MaskedConv2d(module)
        else:
            continue
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, layer)
        wrapped[name] = layer
    unmatched = [t for t in targets if not any(name.endswith(t) for name in wrapped)]
    if unmatched:
        raise ValueError(f"no Linear or Conv2d layer of the backbone matches {unmatched}")
    return wrapped


def buffer_name(layer_name: str) -> str:
    """A module-attribute-safe name for a layer (``blocks.0.attn.qkv`` -> ``blocks_0_attn_qkv``)."""
    return layer_name.replace(".", "_")


class StraightThrough(torch.autograd.Function):
    """Forward: the given binary mask; backward: the gradient passes to the scores unchanged."""

    @staticmethod
    def forward(ctx, scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return mask.to(scores.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def threshold_mask(scores: torch.Tensor, threshold: float) -> torch.Tensor:
    """Piggyback's binariser: 1[scores > threshold], straight-through gradient."""
    return StraightThrough.apply(scores, scores > threshold)


def topk_mask(scores: torch.Tensor, density: float) -> torch.Tensor:
    """Edge-popup's GetSubnet applied to |scores|: 1 on the round(density * numel) largest |scores|, with the
    straight-through gradient taken through |S|, so dL/dS = dL/dm * sign(S) (as the official
    ``GetSubnet.apply(scores.abs())``; a gradient to the signed S pushes every negative score the wrong way)."""
    k = max(1, round(density * scores.numel()))
    magnitude = scores.abs()
    flat = magnitude.detach().flatten()
    top = flat.topk(k, sorted=False).indices  # scattered, not index-assigned: `keep[top] = True` copies a host scalar
    keep = torch.zeros_like(flat, dtype=torch.bool).scatter_(0, top, torch.ones_like(top, dtype=torch.bool))
    return StraightThrough.apply(magnitude, keep.view_as(scores))


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """A boolean tensor -> uint8, 8 entries per byte (zero-padded at the end)."""
    flat = mask.flatten().to(torch.uint8)
    flat = F.pad(flat, (0, (-flat.numel()) % 8))
    weights = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8, device=mask.device)
    return (flat.view(-1, 8) * weights).sum(1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
    """The inverse of :func:`pack_bits`: a boolean tensor of ``shape``."""
    shifts = torch.arange(7, -1, -1, device=packed.device, dtype=torch.uint8)
    bits = (packed[:, None] >> shifts) & 1
    return bits.flatten()[: torch.Size(shape).numel()].view(shape).bool()
