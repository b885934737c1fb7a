"""SimpleCIL (Zhou et al., "Revisiting Class-Incremental Learning with Pre-Trained Models: Generalizability and
Adaptivity are All You Need", 2023): the frozen pretrained ViT's features, one prototype per class, a cosine
classifier, no training.

Prototype of class c (their Eq. 5): p_c = (1 / |D_c|) sum_{x in D_c} phi(x), the mean pre-logit feature
(final-norm CLS token) of the class's training images, seen once without augmentation. Prediction: the class whose
prototype has the largest cosine similarity with phi(x), over the task's classes (TIL) or every seen class (CIL).
It needs no hyperparameter and one forward per training image, and tells whether a prompt or mask method beats
plain frozen features.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from clbench.data import Task
from clbench.methods.base import Method, Phase
from clbench.methods.parts.cosine import cosine_logits


@dataclass
class SimpleCILConfig:
    """SimpleCIL has no hyperparameter: the backbone (and its pretrained weights) is the whole method."""


class SimpleCIL(Method):
    """Class-mean prototypes on a frozen backbone; ``heads[t].weight`` holds task ``t``'s prototypes (its bias is
    unused) and the logits are cosine similarities."""

    Config = SimpleCILConfig
    changes_backbone = False

    def __init__(self, backbone, benchmark, config: SimpleCILConfig) -> None:
        super().__init__(backbone, benchmark, config)
        self.backbone.requires_grad_(False)
        self.sums: torch.Tensor | None = None  # the current task's per-class feature sums while it is observed
        self.counts: torch.Tensor | None = None

    def before_task(self, task: Task) -> None:
        super().before_task(task)
        self.heads[task.id].requires_grad_(False)

    def phases(self, task: Task, epochs: int) -> list[Phase]:
        return [Phase("prototypes", 1, observe=True)]

    def before_phase(self, task: Task, phase: Phase) -> None:
        weight = self.heads[task.id].weight
        self.sums = torch.zeros(weight.shape, dtype=torch.float64, device=weight.device)
        self.counts = torch.zeros(weight.shape[0], dtype=torch.float64, device=weight.device)

    @torch.no_grad()
    def observe(self, x: torch.Tensor, y: torch.Tensor, task: Task, rows: torch.Tensor) -> None:
        assert self.sums is not None and self.counts is not None  # set by before_phase
        local = y - task.offset
        self.sums.index_add_(0, local, self.features(x, task.id).double())
        self.counts.index_add_(0, local, torch.ones_like(local, dtype=torch.float64))

    def observations(self) -> list[torch.Tensor]:
        return [t for t in (self.sums, self.counts) if t is not None]

    @torch.no_grad()
    def after_task(self, task: Task) -> None:
        """Prototypes = class means (a class without images, as in the random-init probe, keeps a zero vector)."""
        assert self.sums is not None and self.counts is not None
        head = self.heads[task.id]
        head.weight.copy_(self.sums / self.counts.clamp(min=1)[:, None])
        head.bias.zero_()
        self.sums = self.counts = None

    def head_logits(self, feats: torch.Tensor, task_id: int) -> torch.Tensor:
        """Cosine similarity between the features and the task's prototypes."""
        return cosine_logits(feats, self.heads[task_id].weight)

    def storage(self) -> dict[str, Any]:
        """32-bit prototypes, one per class; nothing is trained."""
        return {
            "bits_per_task": [{"prototypes": 32 * head.weight.numel()} for head in self.heads],
            "trainable_params": 0,
        }
