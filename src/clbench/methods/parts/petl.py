"""A parameter-efficient module attached to a timm ViT by name, as one switchable whole.

``attach(vit, kind, ...)`` wraps ``vit`` in place with AdaptFormer adapters (``adapter``), SSF (``ssf``) or deep or
shallow VPT prompts (``vpt_deep``, ``vpt_shallow``) and returns a :class:`PETL` handle: the new parameters (the only
trainable ones it adds), and ``active``, which switches every wrapper at once; switched off, the ViT computes exactly
what it computed before it was wrapped (APER's pretrained branch runs the same ViT with its adaptation off).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from clbench.methods.parts.adaptformer import attach_adaptformer
from clbench.methods.parts.ssf import attach_ssf
from clbench.methods.parts.vpt import attach_vpt

KINDS = ("adapter", "ssf", "vpt_deep", "vpt_shallow")


class PETL:
    """The wrappers one :func:`attach` added to a ViT (held, not owned: they are the ViT's modules) and the parameters
    they brought, by their names in the ViT."""

    def __init__(self, vit: VisionTransformer, kind: str, wrappers: list[nn.Module], before: set[int]) -> None:
        self.kind = kind
        self.wrappers = wrappers
        self.named = {name: p for name, p in vit.named_parameters() if id(p) not in before}

    def parameters(self) -> list[nn.Parameter]:
        return list(self.named.values())

    def numel(self) -> int:
        return sum(p.numel() for p in self.named.values())

    def state(self, prefix: str) -> dict[str, torch.Tensor]:
        """The parameters as ``{prefix + name: copy}`` (a run's artifacts)."""
        return {prefix + name: p.detach().clone() for name, p in self.named.items()}

    @torch.no_grad()
    def load(self, tensors: dict[str, torch.Tensor], prefix: str) -> None:
        """Copy :meth:`state`'s tensors back; every parameter must be there."""
        for name, p in self.named.items():
            p.copy_(tensors[prefix + name])

    @property
    def active(self) -> bool:
        return all(w.active for w in self.wrappers)

    @active.setter
    def active(self, on: bool) -> None:
        for wrapper in self.wrappers:
            wrapper.active = on

    @contextmanager
    def off(self) -> Iterator[None]:
        """The ViT as it was before :func:`attach` within the block."""
        self.active = False
        try:
            yield
        finally:
            self.active = True


def attach(
    vit: VisionTransformer,
    kind: str,
    *,
    bottleneck: int = 64,
    scale: float = 0.1,
    dropout: float = 0.1,
    tokens: int = 5,
) -> PETL:
    """Wrap ``vit`` with the ``kind`` of :data:`KINDS` (adapter: ``bottleneck``, ``scale``, ``dropout``; VPT:
    ``tokens`` per set); the new parameters require gradients, the ViT's own are left as they were."""
    before = {id(p) for p in vit.parameters()}
    if kind == "adapter":
        wrappers: list[nn.Module] = attach_adaptformer(vit, bottleneck, scale, dropout)
    elif kind == "ssf":
        wrappers = attach_ssf(vit)
    elif kind in ("vpt_deep", "vpt_shallow"):
        wrappers = attach_vpt(vit, tokens, deep=kind == "vpt_deep")
    else:
        raise ValueError(f"unknown PETL kind {kind!r}: one of {', '.join(KINDS)}")
    handle = PETL(vit, kind, wrappers, before)
    for p in handle.parameters():
        p.requires_grad_(True)
    return handle
