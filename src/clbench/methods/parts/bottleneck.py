"""The bottleneck every adapter is made of: ``up(dropout(activation(down(x))))``, from width d to r and back.

Houlsby's adapter (``clbench.methods.adapter``) adds its input to it; AdaptFormer's (:mod:`.adaptformer`) scales it and
adds it beside the MLP. Each sets its own activation, dropout and initialisation.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


class Bottleneck(nn.Module):
    """``up(dropout(activation(down(x))))`` over the last axis: ``down`` d -> r and ``up`` r -> d, with biases
    (2dr + d + r parameters). Dropout (on the bottleneck, in training only) is skipped at p = 0."""

    def __init__(
        self,
        dim: int,
        bottleneck: int,
        activation: Callable[[torch.Tensor], torch.Tensor],
        dropout: float = 0.0,
        *,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.down = nn.Linear(dim, bottleneck, device=device, dtype=dtype)
        self.up = nn.Linear(bottleneck, dim, device=device, dtype=dtype)
        self.activation = activation
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.activation(self.down(x))
        if self.dropout:
            h = F.dropout(h, self.dropout, self.training)
        return self.up(h)
