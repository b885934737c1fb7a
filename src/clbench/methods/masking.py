"""The masked-Linear mechanism shared by every weight-mask method (PackNet, Piggyback, SupSup, MEAT's FFN masks).

:func:`wrap_linears` swaps the chosen ``nn.Linear`` layers of a timm ViT (``attn.qkv``, ``attn.proj``,
``mlp.fc1``, ``mlp.fc2`` by default) for :class:`MaskedLinear`, which computes ``F.linear(x, W * m, b)``
with ``m`` set by the method before each forward (one tensor per layer: no Python work per weight).
A mask may carry gradients (straight-through scores) or be a stored binary mask.

Binary masks are stored packed, 8 weights per byte (:func:`pack_bits` / :func:`unpack_bits`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

DEFAULT_TARGETS = ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2")


class MaskedLinear(nn.Linear):
    """An ``nn.Linear`` whose weight is multiplied by ``self.mask`` (when set) in the forward pass.

    ``superposed`` (shape (T, out, in)) with ``alpha`` (shape (B, T)) computes, per sample b,
    ``sum_t alpha[b, t] * F.linear(x_b, W * superposed[t])`` (SupSup's superposition of masks, with
    per-sample coefficients so that no sample's prediction depends on another's).
    """

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__(linear.in_features, linear.out_features, bias=linear.bias is not None)
        self.weight = linear.weight
        self.bias = linear.bias
        self.mask: torch.Tensor | None = None
        self.superposed: torch.Tensor | None = None
        self.alpha: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.superposed is not None and self.alpha is not None:
            outs = torch.stack([F.linear(x, self.weight * m.to(self.weight.dtype)) for m in self.superposed], dim=1)
            alpha = self.alpha.to(outs.dtype).view(*self.alpha.shape, *([1] * (outs.dim() - 2)))
            out = (alpha * outs).sum(1)
            return out if self.bias is None else out + self.bias
        weight = self.weight if self.mask is None else self.weight * self.mask.to(self.weight.dtype)
        return F.linear(x, weight, self.bias)


def wrap_linears(model: nn.Module, targets: tuple[str, ...] = DEFAULT_TARGETS) -> dict[str, MaskedLinear]:
    """Replace every Linear whose qualified name ends in one of ``targets``; returns them by name."""
    wrapped: dict[str, MaskedLinear] = {}
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear) and not isinstance(module, MaskedLinear) and name.endswith(targets):
            parent_name, _, child = name.rpartition(".")
            layer = MaskedLinear(module)
            setattr(model.get_submodule(parent_name), child, layer)
            wrapped[name] = layer
    if not wrapped:
        raise ValueError(f"no Linear layer matches {targets}")
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
    """Edge-popup's GetSubnet: 1 on the round(density * numel) largest |scores|, straight-through gradient."""
    k = max(1, round(density * scores.numel()))
    flat = scores.detach().abs().flatten()
    keep = torch.zeros_like(flat, dtype=torch.bool)
    keep[flat.topk(k, sorted=False).indices] = True
    return StraightThrough.apply(scores, keep.view_as(scores))


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
