"""PackNet (Mallya & Lazebnik, CVPR 2018): iterative pruning packs tasks into one network.

Every masked weight has an owner index (uint8; 0 = free, k = task k-1). Task k takes all free weights and
trains only them (gradients of other weights are zeroed), then the fraction ``prune_ratio`` of its weights
with the smallest magnitude is freed (set to 0) in every layer and the rest is retrained; its weights are
then frozen. The last task of the run keeps all the free weights it trained and is neither pruned nor retrained
(the official schedule's prune fraction -1 for the final dataset; ``prune_last=true`` prunes and retrains it
too, clbench's earlier behaviour). Task k is evaluated with the weights owned by tasks <= k. Biases, LayerNorms,
embeddings and the patch embedding (unless ``patch_embed.proj`` is in ``layers``, which packs it too) are trained
with the first task and frozen afterwards.

ViT adaptation (a design choice; the paper used VGG/ResNet): masked layers are ``attn.qkv``, ``attn.proj``,
``mlp.fc1`` and ``mlp.fc2`` of every block (``layers``). The pretrained weights initialise the first task, which is
pruned like every other (the paper's separate ImageNet pruning step is not repeated).
Frozen weights stay bit-identical whatever the optimizer: their gradients are zeroed before each step and
masked weights get no weight decay, so momentum and Adam moments stay zero for them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from clbench.config import require
from clbench.data import Task
from clbench.methods.base import Phase
from clbench.methods.masked_method import MaskedMethod
from clbench.methods.masking import DEFAULT_TARGETS, buffer_name


@dataclass
class PackNetConfig:
    prune_ratio: float = 0.75  # fraction of a task's weights freed after training it (paper: 0.75 per added task)
    retrain_epochs: int = 10  # post-pruning retraining (paper: 10)
    retrain_lr: float | None = 1e-4  # lr of the retrain phase (official scripts: 1e-4); null: trainer.lr
    prune_last: bool = False  # false: the last task is not pruned (official schedule) | true: pruned and retrained
    layers: list[str] = field(default_factory=lambda: list(DEFAULT_TARGETS))

    def __post_init__(self) -> None:
        require(0 <= self.prune_ratio < 1, "method.prune_ratio", self.prune_ratio, "a float in [0, 1)")
        require(self.retrain_epochs >= 0, "method.retrain_epochs", self.retrain_epochs, "an integer >= 0")
        require(self.retrain_lr is None or self.retrain_lr > 0, "method.retrain_lr", self.retrain_lr, "null or > 0")


class PackNet(MaskedMethod):
    """State machine per task: ready -(before_task)-> train -(before_phase retrain: prune)-> retrain
    -(after_task)-> ready. Any other order raises."""

    Config = PackNetConfig
    changes_backbone = True

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        for name, layer in self.layers.items():
            self.register_buffer(f"owner_{buffer_name(name)}", torch.zeros_like(layer.weight, dtype=torch.uint8))
        self.state = "ready"

    def owner(self, name: str) -> torch.Tensor:
        return getattr(self, f"owner_{buffer_name(name)}")

    def _expect(self, *states: str, action: str) -> None:
        if self.state not in states:
            raise RuntimeError(f"PackNet cannot {action} in state {self.state!r} (expected {' or '.join(states)})")

    def before_task(self, task: Task) -> None:
        self._expect("ready", action="start a task")
        if task.id + 1 > torch.iinfo(torch.uint8).max:
            raise RuntimeError("PackNet's uint8 owner index holds at most 255 tasks")
        super().before_task(task)
        for name in self.layers:
            owner = self.owner(name)
            owner[owner == 0] = task.id + 1
        self.state = "train"

    def is_pruned(self, task: Task) -> bool:
        """Every task but the run's last is pruned (``prune_last``: the last too)."""
        return self.config.prune_last or task.id < len(self.tasks) - 1

    def phases(self, task: Task, epochs: int) -> list[Phase]:
        if not self.is_pruned(task):
            return [Phase("train", epochs)]
        return [Phase("train", epochs), Phase("retrain", self.config.retrain_epochs)]

    def before_phase(self, task: Task, phase: Phase) -> None:
        if phase.name == "retrain":
            self._expect("train", action="prune")
            self.prune(task)
            self.state = "retrain"

    @torch.no_grad()
    def prune(self, task: Task) -> dict[str, int]:
        """Free exactly round(prune_ratio * n) of the n weights task ``task`` owns, per layer, smallest |w| first."""
        freed = {}
        for name, layer in self.layers.items():
            owner, weight = self.owner(name).view(-1), layer.weight.view(-1)
            mine = (owner == task.id + 1).nonzero().squeeze(1)
            n = round(self.config.prune_ratio * mine.numel())
            drop = mine[weight[mine].abs().argsort(stable=True)[:n]]
            owner[drop] = 0
            weight[drop] = 0
            freed[name] = n
        return freed

    def after_task(self, task: Task) -> None:
        self._expect("train", "retrain", action="finish a task")
        super().after_task(task)
        self.state = "ready"

    def mask_for(self, name: str, task_id: int) -> torch.Tensor:
        owner = self.owner(name)
        return (owner > 0) & (owner <= task_id + 1)

    def param_groups(self, task: Task, phase: Phase) -> list[dict[str, Any]]:
        groups = super().param_groups(task, phase)
        masked = [layer.weight for layer in self.layers.values()]
        for w in masked:
            w.requires_grad_(True)
        groups.append({"params": masked, "weight_decay": 0.0})
        if phase.name == "retrain" and self.config.retrain_lr is not None:
            for group in groups:
                group["lr"] = self.config.retrain_lr
        if task.id == 0:  # shared parameters (biases, norms, embeddings) learn with the first task only
            ids = {id(w) for w in masked}
            shared = [p for p in self.backbone.parameters() if id(p) not in ids]
            for p in shared:
                p.requires_grad_(True)
            groups.append({"params": shared})
        return groups

    def after_backward(self, task: Task) -> None:
        for name, layer in self.layers.items():
            if layer.weight.grad is not None:
                layer.weight.grad.mul_(self.owner(name) == task.id + 1)

    @torch.no_grad()
    def after_step(self, task: Task) -> None:
        for name, layer in self.layers.items():
            layer.weight.masked_fill_(self.owner(name) == 0, 0.0)

    def storage(self) -> dict[str, Any]:
        out = super().storage()  # heads only: PackNet keeps no per-task mask
        bits = len(self.tasks).bit_length()  # owner ids 0 (free) .. T
        out["shared_bits"] = {"owner_index": self.masked_weights() * bits}
        return out

    def artifacts(self) -> dict[str, torch.Tensor]:
        return super().artifacts() | {f"owner.{name}": self.owner(name).clone() for name in self.layers}

    @torch.no_grad()
    def load_artifacts(self, tensors: dict[str, torch.Tensor]) -> None:
        super().load_artifacts(tensors)
        for name in self.layers:
            self.owner(name).copy_(tensors[f"owner.{name}"])
