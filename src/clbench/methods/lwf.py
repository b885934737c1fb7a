"""LwF, Learning without Forgetting (Li & Hoiem, ECCV 2016 / TPAMI 2017): fine-tuning on the new task while
distilling the outputs that the network had at the task's start on the new task's own images.

Rules (the paper's Alg. 1 as the reference codes below implement it; the rest clbench's choice):

- Teacher: the backbone and old heads as they are at the start of every task t > 0. ``teacher=recorded`` (default):
  their logits on the task's training images are recorded once, before it trains, without augmentation (the test
  transform), and read back by each row's position: the paper's Y_o = CNN(X_n, θ_s, θ_o) and the official code's
  procedure [code:lizhitwo/LearningWithoutForgetting@795176d snippets/PASCALkeeporig.m L161, L182], one forward a
  step; the student then sees augmented images while its targets are the clean images'. ``teacher=online``: a frozen
  deep copy evaluated under no_grad on the student's own (augmented, mixed) batch, as PackNet's, HAT's and FACIL's
  reference codes do [code:arunmallya/packnet@de4ff7e src/lwf.py; joansj/hat@6fd0b9d src/approaches/lwf.py L99-106;
  mmasana/FACIL@e09d2c8 src/approach/lwf.py L120-146], a second forward a step: before the first update the teacher
  is the student on the same input, and the distillation's gradient is exactly zero. Mixup/CutMix with a recorded
  teacher is refused (the student would see a mix of two images, its targets the clean one's): use ``online``.
- Distillation, no T² factor (official vl_nnsoftmaxdiff.m L74-96):
  KD(z_old, z) = −Σ_c softmax(z_old/T)_c log softmax(z/T)_c, averaged over the batch, whose gradient in z is
  (softmax(z/T) − softmax(z_old/T)) / T. ``scope``: ``til`` sums one KD per old head (original, HAT, PackNet);
  ``cil`` takes one softmax over the concatenated old heads (FACIL, mammoth).
- Loss: L = L_new + λ KD (λ = ``lam``), L_new finetune's cross-entropy (``loss_scope``: ``task`` = the new head's
  classes, the original and FACIL; ``seen`` = all seen classes, mammoth), + ``wd_reg`` Σ θ² over every parameter of
  the backbone and heads (mammoth's ``wd_reg`` term; 0 by default: clbench leaves weight decay to the optimizer).
- Warm-up (official: the ``_lock`` stage before ``_lockkeep``; PackNet: ``ft_shared_after``; mammoth's
  ``begin_task``): a phase ``warmup`` of ``warmup_epochs`` in which only the new head trains, on the cross-entropy over
  its own classes whatever ``loss_scope`` (mammoth's warm-up masks the logits to the new classes). The backbone and old
  heads are left out of the optimizer and do not require grad, so weight decay and momentum cannot move them (PackNet's
  zeroed gradients do not prevent that). Then phase ``train``: everything trains.

mammoth's LwF [code:aimagelab/mammoth@cb9a36d models/lwf.py] is ``scope=cil loss_scope=seen teacher=recorded`` with
its ``wd_reg``, λ = its alpha, T = 2 and plain SGD; its recorded teacher sees un-normalised images (a defect not
copied).

The teacher is a submodule ``teacher`` whose parameters were turned into buffers: ``parameters()`` (the optimizer,
``no_weight_decay_ids``, the trainable parameter count) does not see it, ``state_dict()`` (the checkpoint) carries it,
so a run resumed mid-task distils towards the same teacher (the replay builds one of the right shape, the checkpoint
replaces its values), and :meth:`artifacts` leaves it out (evaluation does not use it). It is dropped at the task's end.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from clbench.config import TrainerConfig, require, require_choice
from clbench.data import Task
from clbench.methods.base import Logs, Phase
from clbench.methods.finetune import Finetune, FinetuneConfig


@dataclass
class LwFConfig(FinetuneConfig):
    """LwF's hyperparameters on top of finetune's ``loss_scope`` (CE of the new data) and ``freeze_backbone``."""

    loss_scope: str = "task"  # the new data's CE over the new head, as the original LwF and FACIL
    lam: float = 1.0  # λ_o, the distillation weight (official: 1)
    T: float = 2.0  # the distillation temperature (official: 2)
    scope: str = "til"  # til: one KD per old head | cil: one KD over all old classes
    warmup_epochs: int = 1  # epochs of the new-head-only phase before every task's training
    teacher: str = "recorded"  # recorded: logits recorded once a task (the paper's) | online: on each augmented batch
    wd_reg: float = 0.0  # mammoth's wd_reg: + wd_reg x the sum of every squared parameter, in the train phase

    def __post_init__(self) -> None:
        super().__post_init__()
        require(math.isfinite(self.lam) and self.lam >= 0, "method.lam", self.lam, "a finite float >= 0")
        check_temperature(self.T)
        require(math.isfinite(self.wd_reg) and self.wd_reg >= 0, "method.wd_reg", self.wd_reg, "a finite float >= 0")
        require_choice("method.scope", self.scope, ("til", "cil"))
        require_choice("method.teacher", self.teacher, ("recorded", "online"))
        require(
            isinstance(self.warmup_epochs, int) and self.warmup_epochs >= 0,
            "method.warmup_epochs",
            self.warmup_epochs,
            "an integer >= 0",
        )


SMALLEST_T = torch.finfo(torch.float32).tiny  # 2**-126, fp32's smallest normal number


def check_temperature(temperature: float) -> None:
    """A distillation temperature fp32 can compute with: finite and at least fp32's smallest normal number, 2^-126
    (1.2e-38). Below it T is not an fp32 number (the fp32 logits are divided by T rounded to fp32: a subnormal that
    has lost its precision, or 0 below 2^-149), and the gradient of :func:`distillation` in the logits,
    (softmax(z/T) - softmax(z_old/T)) / T, reaches 1/T in a component: more than fp32's largest number (3.4e38)
    once T < 2.9e-39."""
    require(
        math.isfinite(temperature) and temperature >= SMALLEST_T,
        "method.T",
        temperature,
        f"a finite float >= {SMALLEST_T:.4g} (2**-126, fp32's smallest normal number: the distillation divides fp32 "
        "logits by T, which below it is a subnormal or zero in fp32, and its gradient (softmax(z/T) - "
        "softmax(z_old/T))/T overflows fp32 below 2.9e-39)",
    )


def distillation(z: torch.Tensor, z_old: torch.Tensor, temperature: float) -> torch.Tensor:
    """KD = −Σ_c softmax(z_old/T)_c log softmax(z/T)_c, T = ``temperature``, the mean over the rows, in fp32 (no T²)."""
    target = F.softmax(z_old.float() / temperature, dim=1)
    return -(target * F.log_softmax(z.float() / temperature, dim=1)).sum(1).mean()


class Teacher(nn.Module):
    """A frozen copy of a backbone and heads: every parameter is a buffer, and it stays in eval mode."""

    def __init__(self, backbone: nn.Module, heads: list[nn.Module]) -> None:
        super().__init__()
        self.backbone = copy.deepcopy(backbone)
        self.heads = nn.ModuleList(copy.deepcopy(h) for h in heads)
        for module in self.modules():
            for name, p in list(module._parameters.items()):
                del module._parameters[name]
                module.register_buffer(name, None if p is None else p.detach())
        self.train(False)

    def train(self, mode: bool = True) -> Teacher:
        return super().train(False)

    @torch.no_grad()
    def logits(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Each old head's logits on ``x``."""
        feats = self.backbone.forward_head(self.backbone.forward_features(x), pre_logits=True)
        return [head(feats) for head in self.heads]


class Recorded(nn.Module):
    """A teacher's logits over the old classes on a phase's images, recorded once (an ``observe`` phase: the test
    transform, eval mode) and read back by the rows' positions in that data (``training_loss``'s ``ids``)."""

    def __init__(self, rows: int, classes: int, device: torch.device) -> None:
        super().__init__()
        self.register_buffer("logits", torch.zeros(rows, classes, device=device))


class Distills:
    """What LwF and BiC share: a frozen teacher, the model at the task's start, whose logits over the old classes
    are recorded once before the task trains (``teacher=recorded``: the test transform, one forward a training step)
    or computed on every augmented batch (``online``: the same inputs as the student, a second forward a step).

    A subclass calls :meth:`take_teacher` in ``before_task``, puts :meth:`record_phase` before its training phases and
    reads :meth:`teacher_targets` in its loss; it may override :meth:`teacher_logits` (BiC corrects them)."""

    config: Any
    heads: nn.ModuleList
    backbone: nn.Module
    teacher: Teacher | None  # submodules (no class-level default: it would hide nn.Module's registered one)
    recorded: Recorded | None
    stage: str = "train"  # the phase under way (set by before_phase, which a resume's replay also calls)

    def no_teacher(self) -> None:
        """Neither teacher nor recorded logits (construction, and a task's end)."""
        self.teacher = self.recorded = None

    def take_teacher(self, task: Task, rows: int) -> None:
        """The teacher of ``task`` (none for the first); ``rows``: at most how many images its logits are recorded
        for (the training phase's data)."""
        self.teacher = Teacher(self.backbone, list(self.heads[: task.id])) if task.id else None
        recording = task.id and self.config.teacher == "recorded"
        self.recorded = Recorded(rows, task.offset, self.backbone.cls_token.device) if recording else None

    def record_phase(self, data: str = "task") -> list[Phase]:
        """The phase that records the teacher's logits on ``data`` (that of the training phase that reads them)."""
        return [Phase("record", 1, observe=True, data=data)] if self.recorded is not None else []

    def before_phase(self, task: Task, phase: Phase) -> None:
        self.stage = phase.name
        if phase.name != "record" and self.recorded is not None:
            self.teacher = None  # its logits are recorded: the copy is not needed any more

    @torch.no_grad()
    def teacher_logits(self, x: torch.Tensor, task: Task) -> torch.Tensor:
        """The teacher's logits over every old class."""
        assert self.teacher is not None
        return torch.cat(self.teacher.logits(x), dim=1)

    @torch.no_grad()
    def observe(self, x: torch.Tensor, y: torch.Tensor, task: Task, rows: torch.Tensor) -> None:
        """The record phase: the teacher's logits on the batch, at its rows' positions."""
        assert self.recorded is not None
        self.recorded.logits[rows] = self.teacher_logits(x, task).float()

    def observations(self) -> list[torch.Tensor]:
        """Each rank recorded its rows (the others stay 0): the sum over the ranks is every row."""
        return [self.recorded.logits] if self.recorded is not None and self.stage == "record" else []

    def takes_ids(self) -> bool:
        return self.config.teacher == "recorded"

    def teacher_targets(self, x: torch.Tensor, task: Task, ids: torch.Tensor | None) -> torch.Tensor:
        """The teacher's logits over the old classes for the batch: recorded (read by position) or computed now."""
        if self.recorded is not None:
            assert ids is not None, "a recorded teacher is read by the rows' positions"
            return self.recorded.logits[ids]
        return self.teacher_logits(x, task)


class LwF(Distills, Finetune):
    """``teacher=recorded`` (default): the old heads' responses are recorded once, before the task trains, on its
    images without augmentation (the paper's Alg. 1 and official code: Y_o = CNN(X_n, θ_s, θ_o)), and the student is
    distilled towards them while it sees augmented images. ``online``: the frozen copy runs on the student's own
    (augmented, mixed) batch (PackNet's, HAT's and FACIL's codes)."""

    Config = LwFConfig

    @staticmethod
    def check_trainer(config: LwFConfig, trainer: TrainerConfig) -> None:
        """Mixup/CutMix only with the online teacher: a recorded one gives the clean image's targets to a student that
        sees a mix of two images."""
        require(
            config.teacher == "online" or not (trainer.mixup or trainer.cutmix),
            "method.teacher",
            config.teacher,
            f"online with trainer.mixup={trainer.mixup} / trainer.cutmix={trainer.cutmix} (the teacher then sees the "
            "student's own mixed images), or no mixing",
        )

    def __init__(self, backbone, benchmark, config: LwFConfig) -> None:
        super().__init__(backbone, benchmark, config)
        self.images = [len(split) for split in benchmark.train]  # the size of each task's training data
        self.no_teacher()

    def before_task(self, task: Task) -> None:
        """The teacher: the backbone and old heads as they are at the task's start (none for the first task)."""
        super().before_task(task)
        self.take_teacher(task, self.images[task.id])

    def after_task(self, task: Task) -> None:
        self.no_teacher()

    def phases(self, task: Task, epochs: int) -> list[Phase]:
        return [*self.record_phase(), Phase("warmup", self.config.warmup_epochs), Phase("train", epochs)]

    def param_groups(self, task: Task, phase: Phase) -> list[dict[str, Any]]:
        if phase.name == "warmup":  # only the new head: shared and old parameters are out of the optimizer
            self.backbone.requires_grad_(False)
            self.heads.requires_grad_(False)
            self.heads[task.id].requires_grad_(True)
            return [{"params": list(self.heads[task.id].parameters())}]
        # every head trains (the old ones through the distillation), whatever finetune does with loss_scope=task
        self.backbone.requires_grad_(not self.config.freeze_backbone)
        self.heads.requires_grad_(True)
        return [{"params": [p for p in self.parameters() if p.requires_grad]}]

    def training_loss(
        self, x: torch.Tensor, y: torch.Tensor, task: Task, ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, Logs]:
        feats = self.features(x, task.id)
        if self.config.loss_scope == "task" or self.stage == "warmup":  # the warm-up: the new head's classes only
            new = self.task_loss(self.heads[task.id](feats), y, task)
        else:
            new = F.cross_entropy(self.seen_logits(feats), y)
        if self.stage == "warmup":
            return new, {}  # only the new head trains: nothing the distillation or wd_reg could change
        if self.config.wd_reg:
            squares = [p.float().square().sum() for p in (*self.backbone.parameters(), *self.heads.parameters())]
            new = new + self.config.wd_reg * torch.stack(squares).sum()
        if task.id == 0:
            return new, {}  # nothing old to distil
        old = self.teacher_targets(x, task, ids).split([t.num_classes for t in self.tasks[: task.id]], dim=1)
        student = [self.heads[k](feats) for k in range(task.id)]
        if self.config.scope == "cil":
            kd = distillation(torch.cat(student, 1), torch.cat(old, 1), self.config.T)
        else:
            kd = sum(distillation(s, o, self.config.T) for s, o in zip(student, old, strict=True))
        return new + self.config.lam * kd, {"kd": kd.detach()}
