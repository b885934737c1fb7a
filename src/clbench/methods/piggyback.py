"""Piggyback (Mallya, Davis & Lazebnik, ECCV 2018): learn a binary mask per task over fixed pretrained weights.

Each masked layer gets real-valued scores M_r (init ``init_scale`` = 1e-2 everywhere, so training starts from
the full network); the forward pass uses W * 1[M_r > ``threshold``] (5e-3) and the gradient reaches M_r
through a straight-through estimator. After the task the binary mask is stored (1 bit per weight) and
the scores are dropped. The backbone (weights, biases, LayerNorms, embeddings) never changes.

ViT adaptation: masks on ``attn.qkv``, ``attn.proj``, ``mlp.fc1`` and ``mlp.fc2`` of every block, exactly the
"Piggyback" baseline of MEAT's Table 1 (masks on all block weights). Paper recipe: Adam, lr 1e-4 for masks
and classifier, 30 epochs, batch 32.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from clbench.config import require, require_choice
from clbench.data import Task
from clbench.methods.base import Logs, Phase
from clbench.methods.masked_method import MaskedMethod
from clbench.methods.masking import DEFAULT_TARGETS, buffer_name, threshold_mask


@dataclass
class PiggybackConfig:
    threshold: float = 5e-3  # binariser threshold (paper: DEFAULT_THRESHOLD)
    init_scale: float = 1e-2  # mask_scale: initial score value
    mask_init: str = "ones"  # ones: all scores = init_scale | uniform: U(-init_scale, init_scale)
    mask_lr: float | None = None  # learning rate of the scores (null: trainer.lr, as the paper uses one lr)
    layers: list[str] = field(default_factory=lambda: list(DEFAULT_TARGETS))

    def __post_init__(self) -> None:
        require(self.init_scale > 0, "method.init_scale", self.init_scale, "a float > 0")
        require_choice("method.mask_init", self.mask_init, ("ones", "uniform"))
        require(self.mask_lr is None or self.mask_lr > 0, "method.mask_lr", self.mask_lr, "null or a float > 0")


class Piggyback(MaskedMethod):
    Config = PiggybackConfig

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.scores = nn.ParameterDict()  # the current task's real-valued masks

    def before_task(self, task: Task) -> None:
        super().before_task(task)
        cfg = self.config
        for name, layer in self.layers.items():
            if cfg.mask_init == "ones":
                init = torch.full_like(layer.weight, cfg.init_scale)
            else:
                init = torch.empty_like(layer.weight).uniform_(-cfg.init_scale, cfg.init_scale)
            self.scores[buffer_name(name)] = nn.Parameter(init)

    def mask_for(self, name: str, task_id: int) -> torch.Tensor | None:
        stored = self.stored_mask(name, task_id)
        if stored is not None:
            return stored
        if task_id == self.num_seen - 1 and buffer_name(name) in self.scores:
            return threshold_mask(self.scores[buffer_name(name)], self.config.threshold)
        return None

    def param_groups(self, task: Task, phase: Phase) -> list[dict[str, Any]]:
        groups = super().param_groups(task, phase)
        scores = {"params": list(self.scores.values()), "weight_decay": 0.0}
        if self.config.mask_lr is not None:
            scores["lr"] = self.config.mask_lr
        return [*groups, scores]

    def training_loss(self, x: torch.Tensor, y: torch.Tensor, task: Task) -> tuple[torch.Tensor, Logs]:
        loss, _ = super().training_loss(x, y, task)
        kept = torch.stack([(s > self.config.threshold).float().mean() for s in self.scores.values()]).mean()
        return loss, {"mask_density": kept}

    @torch.no_grad()
    def after_task(self, task: Task) -> None:
        super().after_task(task)
        for name in self.layers:
            self.store_mask(name, task.id, self.scores[buffer_name(name)] > self.config.threshold)
        self.scores.clear()
