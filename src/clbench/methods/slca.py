"""SLCA, Slow Learner with Classifier Alignment (Zhang, Wang, Kang, Chen, Wei, "SLCA: Slow Learner with Classifier
Alignment for Continual Learning on a Pre-trained Model", ICCV 2023; official code GengDavid/SLCA@169d4e6): sequential
fine-tuning of the whole pretrained ViT with a backbone learning rate far below the head's, then the heads aligned on
samples of per-class feature Gaussians.

Rules (the official code's, models/slca.py unless named otherwise), for task t:

- Slow learner (phase ``train``): the backbone and the task's head train with cross-entropy over the task's own
  classes (``logits[:, known:]``, L126-128), the older heads frozen (convs/linears.py L87-89); one SGD, the
  backbone's group at ``backbone_lr_scale`` x the head's lr (bcb_lrscale 1/100: 1e-4 against 0.01, L45-48,
  L154-160), weight decay on every parameter (torch's SGD over both groups, L165: ``weight_decay_on=all``),
  MultiStepLR per epoch (L166). Heads are Linear layers initialised N(0, 0.02) truncated, bias 0 (linears.py L51-55,
  L80-82: ``head_init=trunc_normal``).
- Statistics (phase ``statistics``, an observe pass over the task's training images, test transform, eval mode): the
  pre-alignment heads are kept (``fc.backup()``, L107), then every new class's mean and covariance of the backbone's
  features, in fp64, + 1e-4 I (models/base.py L247-262;
  :class:`~clbench.methods.parts.gaussian_alignment.GaussianAligner`).
- Classifier alignment (phase ``align``, t >= 1, no image read: ``Phase(data="features")``): every head trains on
  256 samples a seen class of N(mu_c (0.9 + 0.1 (k_c + 1) / (t + 1)), Sigma_c) an epoch, with the logit-normalised
  cross-entropy (tau 0.1), SGD lr 0.01, momentum 0.9, weight decay 5e-4, cosine over 5 epochs stepped per epoch
  (L174-256). The task is evaluated with the aligned heads.
- Before the next task the heads return to their pre-alignment copies (``fc.recall()`` in ``after_task``, L75-79,
  here at the next ``before_task``, since clbench evaluates after ``after_task``): each alignment starts from the heads
  as their tasks trained them, and the backbone keeps its fine-tuned weights.
- Prediction: the argmax over the concatenated heads (CIL), a task's own head (TIL); one forward a test image.

The official ViT (convs/vits.py L709-711) replaces the pretrained final LayerNorm by a fresh one (weight 1, bias 0,
eps 1e-5) that then trains with the backbone: ``final_norm=reset`` does the same (the presets select it), ``pretrained``
keeps the weights' own.

Departures (docs/methods/slca.md): a class's task is its own, where the code derives it from the current task's size
(``c // task_size``, L200: the same for the equal tasks of every preset); covariances are kept as fp32 Cholesky factors
instead of fp64 matrices factorised again every epoch, and the samples come from a generator of their own (seeded by
the run's seed, the task and the epoch) instead of the global stream; the statistics are taken in fp32 whatever the
training precision.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from clbench.config import require, require_choice
from clbench.data import Benchmark, Split, Task
from clbench.methods.base import HEAD_INITS, Logs, Method, Phase, init_head
from clbench.methods.parts.gaussian_alignment import AlignmentConfig, GaussianAligner


@dataclass
class SLCAConfig:
    # The backbone's lr as a share of the head's (bcb_lrscale, slca.py L45-48); 0 freezes the backbone.
    backbone_lr_scale: float = 0.01
    # all: weight decay on every parameter, norms and biases too (torch's SGD, L165) | weights: clbench's rule.
    weight_decay_on: str = "all"
    head_init: str = "trunc_normal"  # N(0, 0.02), bias 0 (linears.py L51-55) | default: nn.Linear's | zeros
    final_norm: str = "pretrained"  # pretrained: the weights' final LayerNorm | reset: a fresh one (vits.py L709-711)
    alignment: AlignmentConfig = field(default_factory=AlignmentConfig)  # the classifier alignment (SLCA's values)

    def __post_init__(self) -> None:
        scale = self.backbone_lr_scale
        require(0 <= scale <= 1, "method.backbone_lr_scale", scale, "a float in [0, 1] (0: the backbone is frozen)")
        require_choice("method.weight_decay_on", self.weight_decay_on, ("all", "weights"))
        require_choice("method.head_init", self.head_init, HEAD_INITS)
        require_choice("method.final_norm", self.final_norm, ("pretrained", "reset"))


def reset_final_norm(backbone: nn.Module) -> None:
    """Replace the LayerNorm the pre-logit features leave through (``fc_norm`` of a pooled ViT, else ``norm``) by a
    fresh ``nn.LayerNorm`` (weight 1, bias 0, eps 1e-5), as SLCA's ViT does."""
    name = "fc_norm" if isinstance(getattr(backbone, "fc_norm", None), nn.LayerNorm) else "norm"
    old = getattr(backbone, name)
    setattr(backbone, name, nn.LayerNorm(old.normalized_shape, device=old.weight.device))


class SLCA(Method):
    Config = SLCAConfig

    def __init__(self, backbone, benchmark: Benchmark, config: SLCAConfig) -> None:
        super().__init__(backbone, benchmark, config)
        if config.final_norm == "reset":
            reset_final_norm(self.backbone)
        self.aligner = GaussianAligner(config.alignment, backbone.num_features)
        self.stage = "train"

    @staticmethod
    def unused_keys(config: SLCAConfig) -> dict[str, str]:
        if config.alignment.epochs:
            return {}
        keys = [k for k in vars(config.alignment) if k != "epochs"]
        return {f"method.alignment.{k}": "method.alignment.epochs=0" for k in keys}

    # ----------------------------------------------------------------------------- lifecycle
    def new_head(self, num_classes: int) -> nn.Linear:
        head = super().new_head(num_classes)
        init_head(head, self.config.head_init)
        return head

    def before_task(self, task: Task) -> None:
        """The earlier heads back to their pre-alignment copies (``fc.recall``), then the new head and its class
        Gaussians (zeros until observed)."""
        if task.id:
            self.aligner.restore(self.heads)
        super().before_task(task)
        self.aligner.add_task(self.heads[task.id])

    def phases(self, task: Task, epochs: int) -> list[Phase]:
        return [Phase("train", epochs), Phase("statistics", 1, observe=True), *self.aligner.phases(task)]

    def before_phase(self, task: Task, phase: Phase) -> None:
        self.stage = phase.name
        if phase.name == "statistics":
            self.aligner.keep(self.heads)
            self.aligner.start()
        elif phase.name == "align":
            self.aligner.settle()

    def after_task(self, task: Task) -> None:
        self.aligner.settle()  # the first task has no alignment phase to settle its statistics before
        self.stage = "train"

    def param_groups(self, task: Task, phase: Phase) -> list[dict[str, Any]]:
        """Train: the backbone at ``backbone_lr_scale`` x the lr and the task's head; align: every head."""
        self.requires_grad_(False)
        if phase.name == "align":
            return self.aligner.param_groups(self.heads)
        head = self.heads[task.id].requires_grad_(True)
        groups: list[dict[str, Any]] = [{"params": list(head.parameters())}]
        if self.config.backbone_lr_scale:
            self.backbone.requires_grad_(True)
            groups.append({"params": list(self.backbone.parameters()), "lr_factor": self.config.backbone_lr_scale})
        return groups

    def no_weight_decay_ids(self) -> set[int]:
        """None with ``weight_decay_on=all`` (the official SGD decays every parameter)."""
        return super().no_weight_decay_ids() if self.config.weight_decay_on == "weights" else set()

    # ----------------------------------------------------------------------------- training
    def training_loss(self, x: torch.Tensor, y: torch.Tensor, task: Task) -> tuple[torch.Tensor, Logs]:
        """Train: CE over the task's own classes. Align: ``x`` are drawn features; the aligner's loss over every seen
        class of the heads' logits."""
        if self.stage == "align":
            sizes = [t.num_classes for t in self.tasks[: task.id + 1]]
            with torch.autocast(x.device.type, enabled=False):
                return self.aligner.loss(self.seen_logits(x.float()), y, sizes), {}
        return self.task_loss(self.heads[task.id](self.features(x, task.id)), y, task), {}

    def drawn_split(self, task: Task, phase: Phase, epoch: int) -> Split:
        return self.aligner.draw(self.tasks, task.id, epoch)

    @torch.no_grad()
    def observe(self, x: torch.Tensor, y: torch.Tensor, task: Task, rows: torch.Tensor) -> None:
        """The features of the task's training images, in fp32 whatever the run's precision, into the class sums."""
        with torch.autocast(x.device.type, enabled=False):
            self.aligner.observe(self.features(x.float(), task.id), y - task.offset)

    def observations(self) -> list[torch.Tensor]:
        return self.aligner.observations()

    # ----------------------------------------------------------------------------- bookkeeping
    def storage(self) -> dict[str, Any]:
        """The heads, and per class its mean and covariance factor (and the head's pre-alignment copy)."""
        out = super().storage()
        for t, entry in enumerate(out["bits_per_task"]):
            entry.update(self.aligner.storage_bits(t))
        return out
