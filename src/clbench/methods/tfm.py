"""TFM (Masana, Tuytelaars & van de Weijer, CVPR-W 2021): ternary feature masks, zero forgetting by construction.

**A reconstruction.** Verified (abstract and introduction): masks act on *features* (activations), not weights; they
are ternary, two bits a feature a task; features used by earlier tasks never change; task-specific feature
normalisation lets old features adapt to a new task without changing them for the old ones; task-aware (TIL). The
method section could not be read (no code was released), so the rest is clbench's:

- A feature is a hidden unit of a block's MLP. Each task *grows* ``growth`` x 4d new units per block (new fc1 rows
  with their bias, new fc2 columns), fc1 rows at timm's init and fc2 columns at zero, so a task starts exactly at
  the function of the task before it.
- The ternary state of every unit for task s: 0 unused, 1 used and frozen (the pretrained units; the units of
  earlier tasks with ``reuse=all``), 2 new (its own, trained by s). Task s's MLP is
  fc2(GELU(fc1(h))) + sum over its used grown units W2_u GELU(W1_u h + b1_u).
- Task-specific normalisation: every LayerNorm of the ViT gets one affine (gamma, beta) per task, started from the
  previous task's (the pretrained one for the first); the statistics are per token, as in any LayerNorm.
- Trained by task t: its units, its LayerNorm affines and its head. Everything else is frozen, so every earlier
  task's logits stay bit-identical.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from timm.layers import Mlp
from torch import nn

from clbench.config import require, require_choice
from clbench.data import Task
from clbench.methods.base import Logs, Method, Phase

UNUSED, FROZEN, NEW = 0, 1, 2  # a unit's ternary state for a task (two bits)


def pack_states(states: torch.Tensor) -> torch.Tensor:
    """Ternary states (n,) -> uint8, 4 units a byte, the first unit in the two most significant bits (zero-padded)."""
    codes = F.pad(states.to(torch.uint8), (0, (-states.numel()) % 4)).view(-1, 4)
    shifts = torch.tensor([6, 4, 2, 0], dtype=torch.uint8, device=states.device)
    return (codes << shifts).sum(1, dtype=torch.uint8)


def unpack_states(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The inverse of :func:`pack_states`: the first ``n`` states."""
    shifts = torch.tensor([6, 4, 2, 0], dtype=torch.uint8, device=packed.device)
    return ((packed[:, None] >> shifts) & 3).flatten()[:n].long()


@dataclass
class TFMConfig:
    growth: float = 0.1  # new MLP units a block a task, as a share of the pretrained 4d [clbench's choice]
    reuse: str = "all"  # all: a task uses every earlier task's units (state 1) | own: only the pretrained and its own

    def __post_init__(self) -> None:
        require(0 < self.growth <= 4, "method.growth", self.growth, "a float in (0, 4]")
        require_choice("method.reuse", self.reuse, ("all", "own"))


class TaskLayerNorm(nn.Module):
    """A LayerNorm with one affine (gamma, beta) per task, picked by ``task``; the statistics are the LayerNorm's."""

    def __init__(self, norm: nn.LayerNorm) -> None:
        super().__init__()
        self.shape, self.eps = norm.normalized_shape, norm.eps
        self.pretrained = norm  # frozen: where the first task's affine starts
        self.weights, self.biases = nn.ParameterList(), nn.ParameterList()
        self.task: int | None = None

    def add_task(self) -> None:
        """A new task's affine, a copy of the last task's (the pretrained one for the first)."""
        first = not len(self.weights)
        weight = self.pretrained.weight if first else self.weights[-1]
        bias = self.pretrained.bias if first else self.biases[-1]
        self.weights.append(nn.Parameter(weight.detach().clone()))
        self.biases.append(nn.Parameter(bias.detach().clone()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.task is None:
            raise RuntimeError("TFM's normalisation needs a task id")
        return F.layer_norm(x, self.shape, self.weights[self.task], self.biases[self.task], self.eps)


class GrowingMlp(nn.Module):
    """A timm ``Mlp`` whose hidden layer grows a block of units per task; task ``task`` sees the pretrained units
    and the grown units of the tasks in ``used`` (their mask bits are 1)."""

    def __init__(self, mlp: Mlp) -> None:
        super().__init__()
        self.mlp = mlp
        self.w1, self.b1, self.w2 = nn.ParameterList(), nn.ParameterList(), nn.ParameterList()
        self.used: list[int] | None = None

    def add_task(self, units: int) -> None:
        """Grow ``units`` units: fc1 rows and bias at timm's ViT init (truncated normal, std 0.02; zero bias), fc2
        columns at zero so the block computes what it did before."""
        fc1 = self.mlp.fc1
        self.w1.append(nn.Parameter(nn.init.trunc_normal_(fc1.weight.new_empty(units, fc1.in_features), std=0.02)))
        self.b1.append(nn.Parameter(fc1.weight.new_zeros(units)))
        self.w2.append(nn.Parameter(fc1.weight.new_zeros(self.mlp.fc2.out_features, units)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.used is None:
            raise RuntimeError("TFM's MLP needs a task id")
        m, used = self.mlp, self.used
        w1 = torch.cat([m.fc1.weight, *(self.w1[j] for j in used)])
        b1 = torch.cat([m.fc1.bias, *(self.b1[j] for j in used)])
        w2 = torch.cat([m.fc2.weight, *(self.w2[j] for j in used)], dim=1)
        hidden = m.norm(m.drop1(m.act(F.linear(x, w1, b1))))
        return m.drop2(F.linear(hidden, w2, m.fc2.bias))


class TFM(Method):
    """Ternary feature masks on grown MLP units with per-task LayerNorms (reconstructed, see the module docstring)."""

    Config = TFMConfig
    task_conditioned = True
    changes_backbone = False
    soft_targets = True
    reconstructed = True

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.backbone.requires_grad_(False)
        self.norms: list[TaskLayerNorm] = []
        for name, module in list(self.backbone.named_modules()):
            if isinstance(module, nn.LayerNorm):
                self.norms.append(self.swap(name, TaskLayerNorm(module)))
        self.mlps = [
            self.swap(f"blocks.{i}.mlp", GrowingMlp(block.mlp)) for i, block in enumerate(self.backbone.blocks)
        ]
        self.units = [max(1, round(self.config.growth * m.mlp.fc1.out_features)) for m in self.mlps]

    def swap(self, name: str, module: nn.Module) -> Any:
        parent, _, child = name.rpartition(".")
        setattr(self.backbone.get_submodule(parent), child, module)
        return module

    def used(self, task_id: int) -> list[int]:
        """The tasks whose grown units task ``task_id`` uses."""
        return list(range(task_id + 1)) if self.config.reuse == "all" else [task_id]

    def states(self, task_id: int, block: int) -> torch.Tensor:
        """Task ``task_id``'s ternary state of every unit of ``block`` that exists when it is learned: the pretrained
        units, then each task's grown units in order."""
        pretrained = torch.full((self.mlps[block].mlp.fc1.out_features,), FROZEN)
        used = set(self.used(task_id))
        grown = [
            torch.full((self.units[block],), NEW if j == task_id else FROZEN if j in used else UNUSED)
            for j in range(task_id + 1)
        ]
        return torch.cat([pretrained, *grown])

    @contextmanager
    def task_path(self, task_id: int) -> Iterator[None]:
        for norm in self.norms:
            norm.task = task_id
        for mlp in self.mlps:
            mlp.used = self.used(task_id)
        try:
            yield
        finally:
            for norm in self.norms:
                norm.task = None
            for mlp in self.mlps:
                mlp.used = None

    def features(self, x: torch.Tensor, task_id: int | None) -> torch.Tensor:
        if task_id is None:
            raise ValueError("TFM needs a task id to pick its units and normalisation")
        with self.task_path(task_id):
            return super().features(x, task_id)

    # ----------------------------------------------------------------------------- training
    def before_task(self, task: Task) -> None:
        super().before_task(task)
        self.grow()

    def grow(self) -> None:
        """A new task's units and LayerNorm affines."""
        for norm in self.norms:
            norm.add_task()
        for mlp, units in zip(self.mlps, self.units, strict=True):
            mlp.add_task(units)

    def grown(self, task_id: int) -> list[nn.Parameter]:
        """Task ``task_id``'s units: fc1 rows, their bias and fc2 columns of every block."""
        return [p for m in self.mlps for p in (m.w1[task_id], m.b1[task_id], m.w2[task_id])]

    def affines(self, task_id: int) -> list[nn.Parameter]:
        """Task ``task_id``'s LayerNorm affines."""
        return [p for n in self.norms for p in (n.weights[task_id], n.biases[task_id])]

    def own_parameters(self, task_id: int) -> list[nn.Parameter]:
        """What task ``task_id`` trains: its units, its LayerNorm affines and its head."""
        return [*self.grown(task_id), *self.affines(task_id), *self.heads[task_id].parameters()]

    def param_groups(self, task: Task, phase: Phase) -> list[dict[str, Any]]:
        self.requires_grad_(False)
        params = self.own_parameters(task.id)
        for p in params:
            p.requires_grad_(True)
        return [{"params": params}]

    def training_loss(self, x: torch.Tensor, y: torch.Tensor, task: Task) -> tuple[torch.Tensor, Logs]:
        return self.task_loss(self.task_logits(x, task.id), y, task), {}

    # ----------------------------------------------------------------------------- bookkeeping
    def storage(self) -> dict[str, Any]:
        """Per task: 2 bits a unit that exists when it is learned (its ternary mask), its grown units' weights and
        its LayerNorm affines (32 bits each), its head."""
        out = super().storage()
        for t, entry in enumerate(out["bits_per_task"]):
            entry["masks"] = 2 * sum(len(self.states(t, b)) for b in range(len(self.mlps)))
            entry["units"] = 32 * sum(p.numel() for p in self.grown(t))
            entry["norms"] = 32 * sum(p.numel() for p in self.affines(t))
        return out

    def task_state(self) -> dict[str, torch.Tensor]:
        """Every task's grown units and LayerNorm affines, by their names in the backbone."""
        ours = {id(p) for t in range(self.num_seen) for p in (*self.grown(t), *self.affines(t))}
        return {name: p for name, p in self.backbone.named_parameters() if id(p) in ours}

    def artifacts(self) -> dict[str, torch.Tensor]:
        """Heads, grown units, per-task LayerNorms (the backbone itself never changes) and every task's ternary masks,
        2 bits a unit."""
        out = super().artifacts() | {f"tfm.{k}": v.detach().clone() for k, v in self.task_state().items()}
        for t in range(self.num_seen):
            out |= {f"states.{t}.{b}": pack_states(self.states(t, b)) for b in range(len(self.mlps))}
        return out

    @torch.no_grad()
    def load_artifacts(self, tensors: dict[str, torch.Tensor]) -> None:
        super().load_artifacts(tensors)
        for _ in range(self.num_seen):
            self.grow()
        saved = {k.removeprefix("tfm."): v for k, v in tensors.items() if k.startswith("tfm.")}
        ours = self.task_state()
        if saved.keys() != ours.keys():
            raise ValueError(f"TFM artifacts do not match {self.num_seen} tasks: {sorted(saved.keys() ^ ours.keys())}")
        for name, p in ours.items():
            p.copy_(saved[name])
        for t in range(self.num_seen):
            for b in range(len(self.mlps)):
                states = self.states(t, b)
                if not torch.equal(unpack_states(tensors[f"states.{t}.{b}"].cpu(), len(states)), states):
                    raise ValueError(f"task {t}'s saved unit states differ from method.reuse={self.config.reuse}'s")
