"""Finetune: sequential fine-tuning of the whole ViT, the lower-bound reference point.

Each task trains the backbone and all heads with cross-entropy over every class seen so far (the
"FT-seq" row of L2P's Table 1), so class-incremental accuracy shows the full effect of forgetting and the
recency bias of the growing head; task-incremental accuracy reads each task's own head.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from clbench.config import require_choice
from clbench.data import Task
from clbench.methods.base import Logs, Method, Phase


@dataclass
class FinetuneConfig:
    """``loss_scope``: ``seen`` = CE over all seen classes (class-incremental training, default);
    ``task`` = CE over the current task's classes only (multi-head training)."""

    loss_scope: str = "seen"
    freeze_backbone: bool = False  # L2P's "FT-seq-frozen": train only the heads

    def __post_init__(self) -> None:
        require_choice("method.loss_scope", self.loss_scope, ("seen", "task"))


class Finetune(Method):
    Config = FinetuneConfig

    def param_groups(self, task: Task, phase: Phase) -> list[dict[str, Any]]:
        """The backbone (unless frozen) and the heads: with ``loss_scope=seen`` every head (the CE over all seen
        classes trains them all); with ``task`` only the current one. Earlier heads get no gradient there, and keeping
        them out of the optimizer keeps them bit-identical whatever fills their gradients (an optimizer that treats a
        zero gradient as a step, AdamW's decoupled weight decay moving them with it): TIL forgetting stays exactly 0
        with a frozen backbone (MEAT's "Classifier", L2P's FT-seq-frozen under its code's train mask)."""
        self.backbone.requires_grad_(not self.config.freeze_backbone)
        if self.config.loss_scope == "task":
            for t, head in enumerate(self.heads):
                head.requires_grad_(t == task.id)
        return [{"params": [p for p in self.parameters() if p.requires_grad]}]

    def takes_soft_targets(self) -> bool:
        return self.config.loss_scope == "task"

    def training_loss(self, x: torch.Tensor, y: torch.Tensor, task: Task) -> tuple[torch.Tensor, Logs]:
        feats = self.features(x, task.id)
        if self.config.loss_scope == "task":
            return self.task_loss(self.heads[task.id](feats), y, task), {}
        return F.cross_entropy(self.seen_logits(feats), y), {}
