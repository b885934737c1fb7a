"""Individual: one fully fine-tuned copy of the pretrained ViT per task (MEAT Table 1's "Individual" row).

MEAT (Xue et al., CVPR 2022) §4 / Table 1: the baseline "duplicates the model by the number of the tasks" and "6 more
independent models are trained for the new tasks", the upper bound of its task-incremental table. Each copy starts from
the pretrained weights ([inference]: a from-scratch DeiT could not reach the table's accuracies on the fine-grained
tasks), never from the previous task's copy.

Before task t the backbone as built at setup (``self.backbone``, never trained: it is frozen here) is copied; copy t
and head t are fully fine-tuned with cross-entropy over the task's classes; after the task both are frozen, and no later
optimizer sees them, so task-incremental forgetting is exactly 0 (task j's logits after task T equal those right
after task j, bit for bit). ``features(x, t)`` runs copy t; without a task id (class-incremental evaluation) the task
is inferred by lowest entropy over every copy's prediction (base class: T forward passes). Storage per task: the
whole backbone in fp32 plus the head.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from clbench.data import Benchmark, Task
from clbench.methods.base import Logs, Method, Phase


@dataclass
class IndividualConfig:
    """Individual has no hyperparameters of its own: the trainer's recipe trains every copy."""


class Individual(Method):
    Config = IndividualConfig
    task_conditioned = True
    # Its classifying weights are trained (the copies, saved in the artifacts); the pretrained backbone it copies
    # from never changes and is rebuilt from the config.
    changes_backbone = True
    soft_targets = True

    def __init__(self, backbone: VisionTransformer, benchmark: Benchmark, config: IndividualConfig) -> None:
        super().__init__(backbone, benchmark, config)
        self.backbone.requires_grad_(False)  # the state at setup: the source of every copy
        self.copies = nn.ModuleList()

    def _add_copy(self) -> VisionTransformer:
        fresh = copy.deepcopy(self.backbone).requires_grad_(True)
        self.copies.append(fresh)
        return fresh

    def before_task(self, task: Task) -> None:
        super().before_task(task)
        self._add_copy()

    def features(self, x: torch.Tensor, task_id: int | None) -> torch.Tensor:
        if task_id is None:
            raise ValueError("Individual needs a task id to pick its backbone copy")
        model = self.copies[task_id]
        return model.forward_head(model.forward_features(x), pre_logits=True)

    def param_groups(self, task: Task, phase: Phase) -> list[dict[str, Any]]:
        """Copy ``task.id`` and its head: nothing of earlier tasks (nor the pretrained source)."""
        return [{"params": [*self.copies[task.id].parameters(), *self.heads[task.id].parameters()]}]

    def training_loss(self, x: torch.Tensor, y: torch.Tensor, task: Task) -> tuple[torch.Tensor, Logs]:
        return self.task_loss(self.heads[task.id](self.features(x, task.id)), y, task), {}

    @torch.no_grad()
    def after_task(self, task: Task) -> None:
        self.copies[task.id].requires_grad_(False)
        self.heads[task.id].requires_grad_(False)

    # ----------------------------------------------------------------------------- bookkeeping
    def no_weight_decay_ids(self) -> set[int]:
        """timm's exemptions (position/class tokens, biases, norms) in every copy as in the backbone."""
        skip = {f"copies.{t}.{name}" for t in range(len(self.copies)) for name in self.backbone.no_weight_decay()}
        named = dict(self.named_parameters())
        return super().no_weight_decay_ids() | {id(named[n]) for n in skip if n in named}

    def storage(self) -> dict[str, Any]:
        """Per task, exact fp32 bits: a whole backbone copy and the head."""
        out = super().storage()
        for t, entry in enumerate(out["bits_per_task"]):
            entry["backbone"] = 32 * sum(p.numel() for p in self.copies[t].parameters())
        return out

    def artifacts(self) -> dict[str, torch.Tensor]:
        """Heads and every copy (``copy.<t>.*``); the pretrained source is not saved (the config rebuilds it)."""
        out = {k: v for k, v in super().artifacts().items() if not k.startswith("backbone.")}
        for t, model in enumerate(self.copies):
            out |= {f"copy.{t}.{k}": v.detach().clone() for k, v in model.state_dict().items()}
        return out

    @torch.no_grad()
    def load_artifacts(self, tensors: dict[str, torch.Tensor]) -> None:
        own = {f"backbone.{k}": v for k, v in self.backbone.state_dict().items()}  # unchanged: loads as itself
        super().load_artifacts({k: v for k, v in tensors.items() if not k.startswith("backbone.")} | own)
        for t in range(self.num_seen):
            prefix = f"copy.{t}."
            model = self._add_copy()
            model.load_state_dict({k.removeprefix(prefix): v for k, v in tensors.items() if k.startswith(prefix)})
            model.requires_grad_(False)
            self.heads[t].requires_grad_(False)
