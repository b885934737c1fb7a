"""The bottleneck every adapter is made of: ``up(dropout(activation(down(x))))``, from width d to r and back.

Houlsby's adapter (``clbench.methods.adapter``) adds its input to it; AdaptFormer's (:mod:`.adaptformer`) scales it and
adds it beside the MLP. Each sets its own activation, dropout and initialisation.

Dropout's masks are drawn for the whole batch of a training step (:attr:`Bottleneck.share`, which the method sets
with its ``batch_share``) and a rank of a multi-process run keeps its rows: every rank then consumes random numbers
as one process does, and two ranks train what one process trains.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


class Bottleneck(nn.Module):
    """``up(dropout(activation(down(x))))`` over the last axis: ``down`` d -> r and ``up`` r -> d, with biases
    (2dr + d + r parameters). Dropout (on the bottleneck, in training only) is skipped at p = 0; ``share`` (the
    whole batch's size and this rank's rows, or None: the batch is whole) says which rows of the mask to keep."""

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
        self.share: tuple[int, slice] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.activation(self.down(x))
        if self.dropout and self.training:
            h = h * dropout_mask(h, self.dropout, self.share)
        return self.up(h)


def dropout_mask(h: torch.Tensor, p: float, share: tuple[int, slice] | None) -> torch.Tensor:
    """Inverted dropout's mask for ``h`` (keep with probability 1 - p, scaled by 1 / (1 - p)): drawn for the whole
    batch of ``share`` and cut to its rows, or for ``h`` alone where ``h`` is not that share (another batch)."""
    size, part = share or (len(h), slice(None))
    if len(range(size)[part]) != len(h):
        size, part = len(h), slice(None)
    keep = torch.empty((size, *h.shape[1:]), device=h.device, dtype=h.dtype).bernoulli_(1 - p)
    return keep[part] / (1 - p)
