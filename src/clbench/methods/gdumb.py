"""GDumb, "Greedy sampler and Dumb learner" (Prabhu, Torr & Dokania, ECCV 2020; official code
drimpossible/GDumb@4f412d7): a class-balancing greedy memory, and a model trained on that memory alone whenever a
prediction is needed.

Rules:

- Sampler: the paper's streaming greedy sampler, as RaptorMai/online-continual-learning agents/gdumb.py streams it
  (``memory_sampler = "greedy"``, :meth:`clbench.memory.Memory._greedy`): each task's images in a random stream order;
  an image of a class not in memory, or of one holding fewer than ⌊k / classes in memory⌋, is stored, evicting (when
  full) a random image of the class holding most (ties at random); otherwise it is dropped. It needs no task boundary.
  Not the official code's offline "first ⌊k/C⌋ indices of every class" (src/dataloader.py L74-78) nor mammoth's
  reservoir (models/gdumb.py).
- Learner: after every task's memory update, a ``fit`` phase (``Phase(data="memory")``, ``fit_epochs`` epochs)
  trains the whole model on the memory alone, with cross-entropy over the seen classes. Before every fit the model
  starts "from scratch": on a pretrained backbone that means from the **pretrained weights** (clbench's reading), so
  the backbone is reset to the weights it had when the method was built, and the head of every seen task is
  re-initialised (``reset_parameters``, drawn from the run's seeded torch generator, which every checkpoint saves).
  Nothing learnt on an earlier task survives but the memory. The refit happens after every task (the paper's
  "whenever a prediction is needed": every stage of the accuracy matrix is a prediction), not only after the last
  (fitting once at the end is not offered: the earlier rows would then be untrained heads).
- Prediction: TIL = the task's own head, CIL = argmax over every seen class (the official code's masking, src/utils.py
  L48-64; clbench's heads).

The pretrained weights are kept as a host copy taken when the method is built, not as buffers: a resumed run builds
the method from the same weights file and seed before loading its checkpoint, so the copy is the same, and the
checkpoint does not carry a second backbone.

Departures: CutMix (the official ``--regularization cutmix``) is not available: the loop's mixup/cutmix mixes labels
over the current task's classes, while the memory holds every seen class, so ``trainer.cutmix`` (and ``mixup``) is
refused for gdumb (``takes_soft_targets`` is False). The recipe is clbench's (conf/method/gdumb.yaml): the official SGD
lr 0.05 with cosine warm restarts, batch 16 and 256 passes is for small CNNs trained from scratch (UNVERIFIED for a
ViT). The official best-test-accuracy-over-passes selection (src/main.py L37-41) and fp16 model (L12) are not copied.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from clbench.config import STEP_SAMPLERS, RunConfig, memory_sampler, require
from clbench.data import Task
from clbench.methods.base import Logs, Method, Phase


@dataclass
class GDumbConfig:
    """``fit_epochs``: epochs of each fit over the memory (null: ``trainer.epochs``)."""

    fit_epochs: int | None = None

    def __post_init__(self) -> None:
        require(
            self.fit_epochs is None or (isinstance(self.fit_epochs, int) and self.fit_epochs >= 1),
            "method.fit_epochs",
            self.fit_epochs,
            "null (trainer.epochs) or an integer >= 1",
        )


class GDumb(Method):
    Config = GDumbConfig
    memory_sampler: ClassVar[str | None] = "greedy"
    needs_memory: ClassVar[bool] = True

    def __init__(self, backbone, benchmark, config: GDumbConfig) -> None:
        super().__init__(backbone, benchmark, config)
        # The weights every fit starts from (the pretrained ones): a host copy, rebuilt identically on resume.
        self.pretrained = {k: v.detach().cpu().clone() for k, v in backbone.state_dict().items()}

    @classmethod
    def check_run(cls, cfg: RunConfig) -> None:
        """The fit is GDumb's only training: it needs epochs, and a memory filled from each task's images after the
        task (GDumb takes no training step on them, in which the reservoir and uniform samplers fill theirs)."""
        require(
            cfg.method.fit_epochs is not None or cfg.trainer.epochs >= 1,
            "trainer.epochs",
            cfg.trainer.epochs,
            "an integer >= 1 with method.fit_epochs=null (GDumb's fit, its only training, then takes trainer.epochs "
            "epochs: 0 would record an untrained model's accuracy as GDumb's), or set method.fit_epochs >= 1",
        )
        require(
            not cfg.memory.active or memory_sampler(cfg.memory, cls) not in STEP_SAMPLERS,
            "memory.sampler",
            cfg.memory.sampler,
            "auto (greedy), balanced or herding with GDumb: reservoir and uniform fill the memory during training "
            "steps on the task's images, which GDumb never takes (it trains on the memory alone), so the memory would "
            "hold nothing to fit on",
        )

    def phases(self, task: Task, epochs: int) -> list[Phase]:
        """The memory update from the task's images, then the fit on the memory alone."""
        fit = self.config.fit_epochs if self.config.fit_epochs is not None else epochs
        return [*self.memory_phase(), Phase("fit", fit, data="memory")]

    def before_phase(self, task: Task, phase: Phase) -> None:
        if phase.name == "fit":
            self.reset()

    @torch.no_grad()
    def reset(self) -> None:
        """ "From scratch" on a pretrained backbone: the backbone back to its pretrained weights, every seen head
        re-initialised from the run's generator."""
        self.backbone.load_state_dict(self.pretrained)
        for head in self.heads:
            head.reset_parameters()

    def param_groups(self, task: Task, phase: Phase) -> list[dict[str, Any]]:
        """The whole model: the backbone and every seen head."""
        self.requires_grad_(True)
        return [{"params": list(self.parameters())}]

    def training_loss(self, x: torch.Tensor, y: torch.Tensor, task: Task) -> tuple[torch.Tensor, Logs]:
        """Cross-entropy over every seen class (the memory's rows span them all)."""
        return F.cross_entropy(self.seen_logits(self.features(x, task.id)), y), {}

    def takes_soft_targets(self) -> bool:
        return False  # the loop mixes labels over the current task's classes; the memory holds every seen class

    def extra_results(self) -> dict[str, Any]:
        return {
            "gdumb": {
                "fit_from": "the pretrained backbone weights and freshly initialised heads, before every task's fit",
                "fit_on": "the memory alone",
            }
        }
