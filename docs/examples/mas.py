"""MAS, Memory Aware Synapses (Aljundi et al., "Memory Aware Synapses: Learning what (not) to forget", ECCV 2018), as a
method that lives outside the clbench package: this file and ``conf/method/mas.yaml`` beside it are all it takes.

Each task trains the backbone and the task's own head with cross-entropy over the task's classes, plus the penalty
λ Σ_i Ω_i (θ_i − θ*_i)² (the paper's Eq. 3) on every backbone parameter: θ* is the backbone after the previous task and
Ω_i how much the squared ℓ2 norm of the network's output moves with θ_i, measured on the task's training images
without labels (Eq. 2-4) after the task, and added up over the tasks. Departure: Ω is read from the gradient of a
whole batch's summed squared norms, not example by example (|Σ g| ≤ Σ |g|: a lower bound of the paper's Ω).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from clbench.config import require
from clbench.data import Task
from clbench.methods.base import Logs, Method, Phase


@dataclass
class MASConfig:
    """MAS's one hyperparameter."""

    lam: float = 1.0  # λ, the penalty's weight (the paper's value for object recognition: 1)

    def __post_init__(self) -> None:
        require(math.isfinite(self.lam) and self.lam >= 0, "method.lam", self.lam, "a finite float >= 0")


def key(name: str) -> str:
    """A parameter's name as a buffer name (buffers cannot hold dots)."""
    return name.replace(".", "__")


class MAS(Method):
    """A backbone shared by every task, a head a task; ``omega`` holds Ω and ``anchor`` θ* per backbone parameter."""

    Config = MASConfig

    def __init__(self, backbone, benchmark, config: MASConfig) -> None:
        super().__init__(backbone, benchmark, config)
        # Buffers, created here with their shapes, are saved in every checkpoint: a resumed run gets them back.
        self.omega, self.anchor = nn.Module(), nn.Module()
        for name, p in backbone.named_parameters():
            self.omega.register_buffer(key(name), torch.zeros_like(p, dtype=torch.float32))
            self.anchor.register_buffer(key(name), p.detach().float().clone())
        self.sums: list[torch.Tensor] = []  # the importance pass's running sums (the last one counts the images)

    def phases(self, task: Task, epochs: int) -> list[Phase]:
        """Train on the task; then one pass over its training images to measure the importance Ω."""
        return [Phase("train", epochs), Phase("importance", 1, observe=True)]

    def param_groups(self, task: Task, phase: Phase) -> list[dict[str, Any]]:
        """The backbone and the current task's head (earlier heads are left as their tasks left them)."""
        return [{"params": [*self.backbone.parameters(), *self.heads[task.id].parameters()]}]

    def training_loss(self, x: torch.Tensor, y: torch.Tensor, task: Task) -> tuple[torch.Tensor, Logs]:
        loss = self.task_loss(self.task_logits(x, task.id), y, task)
        if task.id == 0:  # nothing to remember yet
            return loss, {}
        penalty = sum(
            (self.omega.get_buffer(key(n)) * (p.float() - self.anchor.get_buffer(key(n))).square()).sum()
            for n, p in self.backbone.named_parameters()
        )
        penalty = self.config.lam * penalty
        return loss + penalty, {"mas_penalty": penalty.detach()}

    def before_phase(self, task: Task, phase: Phase) -> None:
        if phase.observe:
            self.sums = [torch.zeros_like(b) for b in self.omega.buffers()]
            self.sums.append(torch.zeros((), device=self.backbone.cls_token.device))

    def observe(self, x: torch.Tensor, y: torch.Tensor, task: Task, rows: torch.Tensor) -> None:
        """Add |∂ Σ_x ‖F(x)‖² / ∂θ| of the batch (F: the task's logits; no labels used) to the running sums."""
        params = list(self.backbone.parameters())
        with torch.enable_grad():  # the loop observes under no_grad
            norms = self.task_logits(x, task.id).float().square().sum()
            grads = torch.autograd.grad(norms, params)
        for total, g in zip(self.sums, grads, strict=False):
            total.add_(g.float().abs())
        self.sums[-1] += len(x)

    def observations(self) -> list[torch.Tensor]:
        return self.sums  # added up over the ranks of a multi-process run

    @torch.no_grad()
    def after_task(self, task: Task) -> None:
        """Ω += the task's importance (the sums over its N images, / N); θ* = θ. A resumed run replays this without
        an importance pass (no sums): its checkpoint then restores both."""
        if self.sums:
            count = self.sums[-1].clamp(min=1)
            for omega, total in zip(self.omega.buffers(), self.sums, strict=False):
                omega.add_(total / count)
        for name, p in self.backbone.named_parameters():
            self.anchor.get_buffer(key(name)).copy_(p.detach().float())
        self.sums = []

    def storage(self) -> dict[str, Any]:
        """The heads per task, plus Ω and θ* for the backbone once (32 bits a value each)."""
        out = super().storage()
        floats = sum(b.numel() for b in self.omega.buffers())
        out["shared_bits"] = {"omega": 32 * floats, "anchor": 32 * floats}
        return out
