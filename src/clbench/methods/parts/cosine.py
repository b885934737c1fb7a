"""Cosine logits: SimpleCIL's and APER's prototype classifier, and the sigma-scaled cosine head the PILOT-family codes
train in their first session (``CosineLinear``, zhoudw-zdw/RevisitingCIL@a2e6b71 convs/linears.py L116-138,
RanPAC/RanPAC@012927f inc_net.py L9-48)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def cosine_logits(feats: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """cos(x, w_c) for every row x of ``feats`` and row w_c of ``weight``, in fp32 whatever the autocast around it."""
    with torch.autocast(feats.device.type, enabled=False):
        return F.normalize(feats.float(), dim=1) @ F.normalize(weight.float(), dim=1).T


class CosineHead(nn.Module):
    """logit_c = sigma · cos(x, w_c), with w_c ~ U(-1/sqrt(d), 1/sqrt(d)) and a learnable sigma starting at 1."""

    def __init__(self, dim: int, num_classes: int, device: torch.device | None = None) -> None:
        super().__init__()
        bound = 1.0 / math.sqrt(dim)
        self.weight = nn.Parameter(torch.empty(num_classes, dim, device=device).uniform_(-bound, bound))
        self.sigma = nn.Parameter(torch.ones(1, device=device))

    def forward(self, feats: torch.Tensor) -> torch.Tensor:
        return self.sigma * cosine_logits(feats, self.weight)
