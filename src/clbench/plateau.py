"""Learning rate on a validation plateau with the best-validation weights kept: HAT's paper schedule (Serra et al.,
ICML 2018, Sec. 4 and the official code, joansj/hat): after every epoch the current task's validation loss is
measured; an epoch that improves it keeps a copy of the weights; ``patience`` epochs without improvement divide the
learning rate by ``factor``; the phase ends early once it falls below ``min_lr``; at its end the best epoch's
weights are put back (``trainer.schedule=plateau``, which needs ``data.val_fraction`` > 0)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn


@dataclass
class Plateau:
    """The schedule's state through one phase; ``scale`` multiplies every group's learning rate."""

    patience: int
    factor: float
    wait: int = 0
    scale: float = 1.0
    best_loss: float = math.inf
    best_state: dict[str, torch.Tensor] = field(default_factory=dict)

    def update(self, loss: float, model: nn.Module, lr: float, min_lr: float) -> bool:
        """Take an epoch's validation ``loss``; False once the learning rate ``lr * scale`` fell below ``min_lr``."""
        if loss < self.best_loss:
            self.best_loss, self.wait = loss, self.patience
            self.best_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
            return True
        self.wait -= 1
        if self.wait > 0:
            return True
        self.scale /= self.factor
        self.wait = self.patience
        return lr * self.scale >= min_lr

    def restore_best(self, model: nn.Module) -> None:
        """The best epoch's weights (a phase that never improved on infinity keeps its own)."""
        if self.best_state:
            model.load_state_dict(self.best_state)

    def state(self) -> dict[str, Any]:
        return asdict(self)
