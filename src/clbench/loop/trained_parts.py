"""Which parameters a phase trains, by part of the model: the ViT's block weights, embeddings and norms, the heads,
and the method's own (masks, prompts, adapters, gates). Said when a phase starts and kept in results.json
(``trained_parameters``), so that a preset that freezes what it should train is visible at once.

The ViT's parts are named from its parameters before a method wraps any layer (:func:`backbone_parts`); a copy of
the ViT a method keeps (Individual's per-task backbones) is recognised by the same names.
"""

from __future__ import annotations

import torch
from timm.models.vision_transformer import VisionTransformer
from torch import nn

PARTS = ("block weights", "embeddings", "norms", "heads", "method's own")
EMBEDDINGS = ("patch_embed", "pos_embed", "cls_token", "reg_token", "dist_token")


def backbone_part(name: str) -> str:
    """The part a timm ViT parameter belongs to: ``pos_embed`` -> embeddings, ``blocks.3.norm1.weight`` -> norms,
    ``blocks.3.attn.qkv.weight`` -> block weights (also layer scales and Refiner's attention)."""
    path = name.split(".")
    if path[0] in EMBEDDINGS:
        return "embeddings"
    return "norms" if any("norm" in module for module in path[:-1]) else "block weights"


def backbone_parts(backbone: VisionTransformer) -> dict[str, str]:
    """Each parameter name of the ViT as built (before a method changes it) -> its part."""
    return {name: backbone_part(name) for name, _ in backbone.named_parameters()}


def parameter_parts(method: nn.Module, names: dict[str, str]) -> dict[int, str]:
    """``id(parameter)`` -> part for every parameter of ``method``: the ViT's own (in any ViT module of the method,
    under a name ``names`` knows), the heads (``heads.*``), and the rest, the method's own."""
    parts: dict[int, str] = {}
    for module in method.modules():
        if isinstance(module, VisionTransformer):
            for name, p in module.named_parameters():
                if name in names:
                    parts.setdefault(id(p), names[name])
    for name, p in method.named_parameters():
        parts.setdefault(id(p), "heads" if name.startswith("heads.") else "method's own")
    return parts


def trained_counts(optimizer: torch.optim.Optimizer, parts: dict[int, str]) -> dict[str, int]:
    """The number of scalars the optimizer updates, by part."""
    counts = dict.fromkeys(PARTS, 0)
    params = {id(p): p for group in optimizer.param_groups for p in group["params"]}
    for key, p in params.items():
        counts[parts.get(key, "method's own")] += p.numel()
    return counts


def describe_counts(counts: dict[str, int]) -> str:
    """``block weights 21.3M, heads 1.5K; frozen: embeddings, norms, method's own``."""

    def size(n: int) -> str:
        return f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.1f}K" if n >= 1e3 else str(n)

    trained = ", ".join(f"{part} {size(n)}" for part, n in counts.items() if n)
    frozen = [part for part, n in counts.items() if not n]
    return trained + (f"; frozen: {', '.join(frozen)}" if frozen else "")
