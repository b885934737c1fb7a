"""VPT, visual prompt tuning (Jia et al., "Visual Prompt Tuning", ECCV 2022), as APER and RanPAC use it
(zhoudw-zdw/RevisitingCIL@a2e6b71 and RanPAC/RanPAC@012927f, ``vpt.py``: ``VPT_ViT.__init__`` and
``forward_features``).

``n`` learnable tokens, initialised to zeros, are appended after the patch tokens (after the position embedding,
which they do not get):

- deep: before every block its own n tokens are appended and after it the last n tokens are dropped;
- shallow: n tokens are appended before the first block and dropped after the last.

Attention stays timm's (fused) attention over the longer sequence; the class token and the patch tokens read the
prompts, and pooling (class token or patch average) never sees them.
"""

from __future__ import annotations

import torch
from timm.models.vision_transformer import VisionTransformer
from torch import nn


class PromptedBlock(nn.Module):
    """A block that first appends ``prompts`` (n x d, or None: nothing) to its input's tokens and drops its output's
    last ``drop`` tokens; the bare block while ``active`` is False."""

    def __init__(self, block: nn.Module, prompts: nn.Parameter | None, drop: int) -> None:
        super().__init__()
        self.block = block
        self.prompts = prompts
        self.drop = drop
        self.active = True

    def forward(self, x: torch.Tensor, **kwargs: torch.Tensor) -> torch.Tensor:
        if not self.active:
            return self.block(x, **kwargs)
        if self.prompts is not None:
            x = torch.cat([x, self.prompts.expand(len(x), -1, -1)], dim=1)
        out = self.block(x, **kwargs)
        return out[:, : out.shape[1] - self.drop] if self.drop else out


def attach_vpt(vit: VisionTransformer, tokens: int = 5, deep: bool = True) -> list[PromptedBlock]:
    """Wrap every block of ``vit`` for deep (a set of ``tokens`` prompts per block) or shallow prompts; returns the
    wrapped blocks (their ``prompts`` are trainable)."""
    like = vit.pos_embed
    depth, wrapped = len(vit.blocks), []
    for i in range(depth):
        gets = deep or i == 0
        prompts = nn.Parameter(torch.zeros(1, tokens, vit.embed_dim, device=like.device, dtype=like.dtype))
        drops = tokens if deep or i == depth - 1 else 0
        wrapped.append(PromptedBlock(vit.blocks[i], prompts if gets else None, drops))
        vit.blocks[i] = wrapped[-1]
    return wrapped
