"""SD-LoRA, Scalable Decoupled LoRA (Wu, Piao, Huang, Wang, Li, Pfister, Meng, Ma, Wei, "SD-LoRA: Scalable Decoupled
Low-Rank Adaptation for Class Incremental Learning", ICLR 2025): a frozen pretrained ViT whose q and v projections
take one low-rank update a task; once a task is learnt its update's direction is frozen and only its magnitude goes on
learning. Official code WuYichen-97/SD-Lora-CL@8bacded (models/sdlora.py, backbone/lora.py, utils/inc_net.py).

Every block's q and v (:mod:`clbench.methods.parts.lora`, all 12 blocks, rank r = 10: sdlora.py L86) at task t:

    Δ = Σ_{i<t} α_i g_i B_i A_i + α_t B_t A_t        (lora.py L153-195)

with one magnitude α_i per task shared by every block and both targets, each starting at 0.8 (``wrapped_param``,
``wrapped_param_prev``, L326-328); A_t Kaiming-uniform, B_t = 0 (L378-384). Trained at task t: A_t, B_t, α_t, the
earlier α_i and the task's head (the code's optimizer has every parameter; the old head rows get no gradient and there
is no weight decay, sdlora.py L95-121); cross-entropy over the task's own classes (L229-236; task 0: its only classes).
The head is one Linear over the seen classes with bias, rows Kaiming-uniform (gain 1: U(±√(3/d))) and bias 0
(backbone/linears.py L27-29): here a head a task, initialised the same. CIL: argmax over every seen class, one ViT
forward (models/base.py L158-173).

Where the finished task's component goes (``alpha_carry``):

- ``reset`` (the code's path): at the start of every task the ViT is rebuilt (sdlora.py L68-90, L109): every earlier
  component is reloaded with its direction normalised, g_i = 1 / (‖B_i‖_F ‖A_i‖_F) (lora.py L183-188), and every α_i
  is a fresh 0.8: the learnt magnitudes are discarded (``save_wrap_param``, which would keep them, is never called), so
  the function jumps at each task boundary before any training.
- ``keep`` (default): the finished component enters the bank as it was learnt, α_t B_t A_t (g = 1), and every α_i
  keeps its learnt value and goes on learning: the function carries over the boundary unchanged. The decoupling the
  paper describes is kept (each earlier direction fixed, one trainable magnitude each); what is dropped is the code's
  reset of the learnt magnitudes.

results.json's config records which was run (``method.alpha_carry``); its ``sdlora`` entry the magnitudes per task.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from clbench.config import require, require_choice
from clbench.data import Benchmark, Task
from clbench.methods.base import Logs, Method, Phase
from clbench.methods.parts import lora


@dataclass
class SDLoRAConfig:
    rank: int = 10  # r of every q and v update (sdlora.py L86)
    alpha_init: float = 0.8  # every magnitude's start (lora.py L326-328)
    alpha_carry: str = "keep"  # keep: learnt magnitudes and the function carried over | reset: the official code's

    def __post_init__(self) -> None:
        require(isinstance(self.rank, int) and self.rank >= 1, "method.rank", self.rank, "an integer >= 1")
        require(math.isfinite(self.alpha_init), "method.alpha_init", self.alpha_init, "a finite float")
        require_choice("method.alpha_carry", self.alpha_carry, ("keep", "reset"))


class SDLoRA(Method):
    """Per-task heads over the LoRA-adapted ViT's features; ``alpha`` holds α_i (bank) and α_t (current)."""

    Config = SDLoRAConfig
    changes_backbone = False  # the pretrained weights never change; the components are saved on their own

    def __init__(self, backbone: VisionTransformer, benchmark: Benchmark, config: SDLoRAConfig) -> None:
        super().__init__(backbone, benchmark, config)
        backbone.requires_grad_(False)
        device = backbone.pos_embed.device
        self.alpha = lora.Magnitudes(len(self.tasks), init=config.alpha_init, trainable=True, device=device)
        self.lora = lora.attach(backbone, ("q", "v"), config.rank, len(self.tasks), self.alpha)

    def new_head(self, num_classes: int) -> nn.Linear:
        """The code's ``SimpleLinear``: weight Kaiming-uniform with gain 1 (U(±√(3/d))), bias 0."""
        head = super().new_head(num_classes)
        with torch.no_grad():
            nn.init.kaiming_uniform_(head.weight, nonlinearity="linear")
            head.bias.zero_()
        return head

    def before_task(self, task: Task) -> None:
        """Freeze the finished task's component into the bank and start this task's (``update_network``)."""
        super().before_task(task)
        if task.id == 0:
            return
        finished = task.id - 1
        if self.config.alpha_carry == "reset":
            gains = [normalising_gain(w.current_norms()) for w in self.lora.wrappers]
        else:
            gains = [torch.ones_like(w.bank_gain[finished]) for w in self.lora.wrappers]
        self.lora.advance(finished, gains)
        with torch.no_grad():
            if self.config.alpha_carry == "reset":
                self.alpha.bank[: task.id].fill_(self.config.alpha_init)
            else:
                self.alpha.bank[finished] = self.alpha.current
            self.alpha.current.fill_(self.config.alpha_init)

    def param_groups(self, task: Task, phase: Phase) -> list[dict[str, Any]]:
        """The current A and B of every block, every magnitude, the task's head (one group, as the code's SGD)."""
        return [{"params": [*self.lora.current(), *self.alpha.parameters(), *self.heads[task.id].parameters()]}]

    def training_loss(self, x: torch.Tensor, y: torch.Tensor, task: Task) -> tuple[torch.Tensor, Logs]:
        return self.task_loss(self.task_logits(x, task.id), y, task), {}

    # ----------------------------------------------------------------------------- bookkeeping
    def magnitudes(self) -> list[float]:
        """α_i of every task seen so far: the bank's, then the current task's."""
        seen = self.num_seen
        alpha = self.alpha.bank.detach()[: max(seen - 1, 0)].tolist()
        return alpha + ([float(self.alpha.current.detach())] if seen else [])

    def storage(self) -> dict[str, Any]:
        """Per task: its head, its q/v component over every block (32-bit) and its magnitude."""
        component = 32 * self.lora.numel_per_component()
        per_task = [{"head": 32 * sum(p.numel() for p in h.parameters()), "lora": component, "magnitude": 32}
                    for h in self.heads]  # fmt: skip
        return {"bits_per_task": per_task, "trainable_params": super().storage()["trainable_params"]}

    def extra_results(self) -> dict[str, Any]:
        return {"sdlora": {"alpha_carry": self.config.alpha_carry, "alpha_per_task": self.magnitudes()}}

    def artifacts(self) -> dict[str, torch.Tensor]:
        return super().artifacts() | self.lora.state("lora.")

    @torch.no_grad()
    def load_artifacts(self, tensors: dict[str, torch.Tensor]) -> None:
        super().load_artifacts(tensors)
        self.lora.load(tensors, "lora.")


def normalising_gain(norms: torch.Tensor) -> torch.Tensor:
    """1 / (‖B‖_F ‖A‖_F) per target; 0 where B is 0 (a component that never trained adds nothing, where the code
    divides 0 by 0)."""
    return torch.where(norms > 0, 1 / norms.clamp_min(torch.finfo(norms.dtype).tiny), torch.zeros_like(norms))
