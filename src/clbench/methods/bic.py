"""BiC, Bias Correction (Wu et al., "Large Scale Incremental Learning", CVPR 2019; official code
wuyuebupt/LargeScaleIncrementalLearning@7f687a3): full fine-tuning with distillation on the task's data and a herding
memory, then a two-parameter bias layer on the newest classes' logits.

Rules (the official code's; the ViT form is clbench's), for task t with n old and m new classes and a memory of K
images in all:

- Stage 1 (phase ``train``, ``Phase(data="task+memory")``: the task's images and the memory's shuffled into the same
  batches, imagenet_main.py L442-448): L = λ·L_d + (1 − λ)·L_c with λ = n / (n + m) (code: itera/(itera+1),
  resnet.py L627-632).
  L_c = cross-entropy over every seen class (L603-604). L_d = −Σ softmax(ô/T) log softmax(o/T) over the **old**
  classes (one softmax over all of them), T = 2, no T² (L606-609; :func:`clbench.methods.lwf.distillation`), between
  the teacher's logits ô and the current model's o. The teacher is the model at the task's start
  (:class:`clbench.methods.lwf.Teacher`: backbone and old heads); ``teacher=online`` evaluates it on the student's own
  augmented batch, as the official code's graph does; ``recorded`` (clbench's default, one forward a step instead of
  two) records its logits once on stage 1's images without augmentation. Its newest block (task t − 1's classes) is
  first corrected with that task's (β, γ) (L560-578): for t ≥ 2, since task 0 has no bias stage (its (β, γ) stay
  (1, 0)). The first task (nothing old, empty memory) trains on its data with L_c alone.
- Validation (imagenet_main.py L439, L450-454): the bias stage of task t takes ⌊0.1 · K / n⌋ images of every class,
  old and new (at least one, clbench's: the code's 0 for a memory under 10 images a class would leave nothing to fit):
  the old classes' from the memory, the new classes' drawn at random at the task's start and left out of its training
  (the first task holds out ⌊0.1 · K / m⌋ of its own classes, what the second task's bias stage takes of them). Stage 1
  never trains on a validation image.
- Stage 2 (phase ``bias``, ``Phase(data="validation")``, t ≥ 1): only (β_t, γ_t) train (the backbone and the heads are
  out of the optimizer and run in eval mode without gradients; the official code's training mode here is not copied):
  q = β_t·o + γ_t on the newest task's logits, the others unchanged; loss = CE over every seen class +
  ``gamma_penalty``·γ_t²/2 (0.1, L633-637, L661-662); β = 1, γ = 0 initially (L587-595).
- Memory (phase ``memory``, after the bias stage, as the code's exemplar management after each step,
  imagenet_main.py L480-535): every seen class keeps ⌈K / (n + m)⌉ − ⌈0.1 · K / (n + m)⌉ training images chosen by
  herding on the pre-logit features of the model after stage 1 (``memory_sampler = "herding"``,
  :func:`clbench.memory.herding`): a new class among its task's images, an old class among its own images in memory
  (``memory.reselect=true``, conf/method/bic.yaml; false keeps the first ones chosen, iCaRL's rule), and the first
  ⌊0.1 · K / (n + m)⌋ of its validation images.
- Prediction: CIL = argmax over [old logits, β_t·newest + γ_t] with the latest task's (β, γ) only (L505-521;
  :meth:`seen_logits`); earlier (β, γ) only shape distillation targets. TIL = the task's own head, uncorrected (an
  affine map with β > 0 leaves the argmax within a block unchanged).

(β_t, γ_t) are per-task parameters created in ``before_task`` as (1, 0), so a resume's replay builds them and the
checkpoint fills them; :meth:`artifacts` saves them (``bias.beta.<t>``, ``bias.gamma.<t>``) so clbench-eval reproduces
the predictions. The teacher exists during a task only (buffers, in the checkpoint mid-task, not in the artifacts).

With ``data.store=stream``, stage 1 and the bias stage stream the memory's images from the on-disk cache with the
task's (each was stored with its position in the training data), so both stores train on the same batches.

Departures: the validation images are held out task by task (a class's when it arrives), not for every class of the
benchmark before the first task (utils_imagenet.py L39-79); at least one a class. The recipe is clbench's
(conf/method/bic.yaml), not BiC's ResNet-18 SGD one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from clbench.config import require, require_choice
from clbench.data import Benchmark, Task
from clbench.methods.base import Logs, Method, Phase
from clbench.methods.lwf import Distills, check_temperature, distillation


@dataclass
class BiCConfig:
    T: float = 2.0  # distillation temperature (official: 2)
    gamma_penalty: float = 0.1  # weight of γ²/2 in the bias stage's loss (official: 0.1)
    bias_epochs: int | None = None  # epochs of the bias stage over the memory (null: 2 x trainer.epochs, _BIAS_EPOCHS)
    bias_lr: float | None = None  # the bias stage's learning rate (null: trainer.lr)
    teacher: str = "recorded"  # recorded: logits recorded once a task | online: on each augmented batch (official)

    def __post_init__(self) -> None:
        check_temperature(self.T)
        require(
            math.isfinite(self.gamma_penalty) and self.gamma_penalty >= 0,
            "method.gamma_penalty",
            self.gamma_penalty,
            "a finite float >= 0",
        )
        require(
            self.bias_epochs is None or (isinstance(self.bias_epochs, int) and self.bias_epochs >= 0),
            "method.bias_epochs",
            self.bias_epochs,
            "null (2 x trainer.epochs) or an integer >= 0",
        )
        require(
            self.bias_lr is None or (math.isfinite(self.bias_lr) and self.bias_lr > 0),
            "method.bias_lr",
            self.bias_lr,
            "null (trainer.lr) or a finite float > 0",
        )
        require_choice("method.teacher", self.teacher, ("recorded", "online"))


def distillation_weight(old: int, new: int) -> float:
    """λ = n / (n + m): the distillation's share of stage 1's loss with n old and m new classes."""
    return old / (old + new)


def bias_correct(logits: torch.Tensor, start: int, beta: torch.Tensor, gamma: torch.Tensor) -> torch.Tensor:
    """``logits`` with its columns from ``start`` on (the newest task's block) mapped to β·o + γ, the rest unchanged."""
    return torch.cat([logits[:, :start], beta * logits[:, start:] + gamma], dim=1)


class BiC(Distills, Method):
    Config = BiCConfig
    memory_sampler: ClassVar[str | None] = "herding"
    needs_memory: ClassVar[bool] = True
    memory_holdout: ClassVar[float] = 0.1  # of each class's memory share, held out for the bias stage (official nb_val)

    def __init__(self, backbone, benchmark: Benchmark, config: BiCConfig) -> None:
        super().__init__(backbone, benchmark, config)
        self.beta = nn.ParameterList()  # per task; the latest one corrects CIL predictions
        self.gamma = nn.ParameterList()
        self.images = [len(split) for split in benchmark.train]  # the size of each task's training data
        self.no_teacher()

    # ----------------------------------------------------------------------------- lifecycle
    def before_task(self, task: Task) -> None:
        """The task's head and (β, γ) = (1, 0); the teacher: the model as it is at the task's start (from task 1)."""
        super().before_task(task)
        self.add_bias()
        memory = self.memory.capacity if self.memory is not None else 0
        self.take_teacher(task, self.images[task.id] + memory)  # stage 1's data: the task's and the memory's

    def add_bias(self) -> None:
        device = self.backbone.cls_token.device
        self.beta.append(nn.Parameter(torch.ones(1, device=device)))
        self.gamma.append(nn.Parameter(torch.zeros(1, device=device)))

    def after_task(self, task: Task) -> None:
        """Drop the teacher; every parameter requires grad again (the storage count sees the whole model)."""
        self.no_teacher()
        self.stage = "train"
        self.requires_grad_(True)

    def phases(self, task: Task, epochs: int) -> list[Phase]:
        """Stage 1 (on the task's data and the memory), from task 1 the bias stage (on the validation images of every
        seen class), then the memory update (the official code's order)."""
        bias = self.config.bias_epochs if self.config.bias_epochs is not None else 2 * epochs
        data = "task+memory" if task.id else "task"
        stage2 = [Phase("bias", bias, data="validation")] if task.id else []
        return [*self.record_phase(data), Phase("train", epochs, data=data), *stage2, *self.memory_phase()]

    def train(self, mode: bool = True) -> BiC:
        """As any module; in the bias stage the backbone and heads stay in eval mode (their logits are the test's)."""
        super().train(mode)
        if getattr(self, "stage", None) == "bias":
            self.backbone.train(False)
            self.heads.train(False)
        return self

    def param_groups(self, task: Task, phase: Phase) -> list[dict[str, Any]]:
        """Stage 1: the backbone and every head; the bias stage: (β_t, γ_t) alone."""
        self.requires_grad_(False)
        if phase.name == "bias":
            self.beta[task.id].requires_grad_(True)
            self.gamma[task.id].requires_grad_(True)
            group: dict[str, Any] = {"params": [self.beta[task.id], self.gamma[task.id]]}
            if self.config.bias_lr is not None:
                group["lr"] = self.config.bias_lr
            return [group]
        self.backbone.requires_grad_(True)
        self.heads.requires_grad_(True)
        return [{"params": [*self.backbone.parameters(), *self.heads.parameters()]}]

    # ----------------------------------------------------------------------------- losses
    def training_loss(
        self, x: torch.Tensor, y: torch.Tensor, task: Task, ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, Logs]:
        if self.stage == "bias":
            return self.bias_loss(x, y, task)
        logits = self.raw_seen_logits(self.features(x, task.id))
        ce = F.cross_entropy(logits, y)
        if task.id == 0:
            return ce, {}
        lam = distillation_weight(task.offset, task.num_classes)
        kd = distillation(logits[:, : task.offset], self.teacher_targets(x, task, ids), self.config.T)
        return lam * kd + (1 - lam) * ce, {"kd": kd.detach(), "ce": ce.detach()}

    @torch.no_grad()
    def teacher_logits(self, x: torch.Tensor, task: Task) -> torch.Tensor:
        """The teacher's logits over the old classes, its newest block (task t − 1) corrected by that task's (β, γ)."""
        old = super().teacher_logits(x, task)
        last = self.tasks[task.id - 1]
        return bias_correct(old, last.offset, self.beta[task.id - 1].detach(), self.gamma[task.id - 1].detach())

    def bias_loss(self, x: torch.Tensor, y: torch.Tensor, task: Task) -> tuple[torch.Tensor, Logs]:
        """CE over every seen class of the corrected logits + γ_t²·penalty/2; only (β_t, γ_t) get gradients."""
        with torch.no_grad():
            logits = self.raw_seen_logits(self.features(x, task.id)).float()
        beta, gamma = self.beta[task.id], self.gamma[task.id]
        ce = F.cross_entropy(bias_correct(logits, task.offset, beta, gamma), y)
        penalty = self.config.gamma_penalty * gamma.square().sum() / 2
        return ce + penalty, {"beta": beta.detach().sum(), "gamma": gamma.detach().sum()}

    # ----------------------------------------------------------------------------- inference
    def raw_seen_logits(self, feats: torch.Tensor) -> torch.Tensor:
        """Every seen head's logits, uncorrected."""
        return super().seen_logits(feats)

    def seen_logits(self, feats: torch.Tensor) -> torch.Tensor:
        """CIL logits: the newest task's block corrected by its (β, γ), the older blocks as they are."""
        logits = self.raw_seen_logits(feats)
        last = self.num_seen - 1
        if last < 0:
            return logits
        return bias_correct(logits, self.tasks[last].offset, self.beta[last], self.gamma[last])

    # ----------------------------------------------------------------------------- bookkeeping
    def storage(self) -> dict[str, Any]:
        out = super().storage()
        for entry in out["bits_per_task"]:
            entry["bias"] = 2 * 32  # (β_t, γ_t) in fp32
        return out

    def artifacts(self) -> dict[str, torch.Tensor]:
        out = super().artifacts()
        for t in range(self.num_seen):
            out[f"bias.beta.{t}"] = self.beta[t].detach().clone()
            out[f"bias.gamma.{t}"] = self.gamma[t].detach().clone()
        return out

    @torch.no_grad()
    def load_artifacts(self, tensors: dict[str, torch.Tensor]) -> None:
        super().load_artifacts(tensors)
        for t in range(self.num_seen):
            self.add_bias()
            self.beta[t].copy_(tensors[f"bias.beta.{t}"])
            self.gamma[t].copy_(tensors[f"bias.gamma.{t}"])

    def extra_results(self) -> dict[str, Any]:
        return {
            "bic": {
                "beta": [float(b.detach()) for b in self.beta],
                "gamma": [float(g.detach()) for g in self.gamma],
                "bias_fit_on": "the held-out validation images of every seen class (never trained on by the model)",
            }
        }
