"""DER++ (Buzzega et al., "Dark Experience for General Continual Learning: a Strong, Simple Baseline", NeurIPS 2020;
official code aimagelab/mammoth ``models/derpp.py``): experience replay of the model's own past logits.

Eq. 6 / Alg. 2: L = CE(f(x), y) + alpha * MSE(f(x'_1), z_1) + beta * CE(f(x'_2), y_2), where (x'_1, z_1) and
(x'_2, y_2) are two independent draws of M memory images (augmented at the draw), z the logits stored with an image
and MSE the mean over the logit entries. After the optimizer step the current batch is offered to the reservoir with
its un-augmented images, labels and the logits the model gave its augmented images in this step, before the update
(``outputs.data``): logits sampled along the optimisation trajectory. ``alpha`` alone (``beta=0``) is DER.

On clbench's growing heads a stored logit vector covers the classes seen when it was stored; the MSE is taken over
those entries only, each row's mean over its width, then the mean over the rows (mammoth's mean over M x C entries
where every row has the same width; a row weighs the same whatever its width, and ranks of a multi-process run
average exactly). mammoth's single head over every class also pulls the untrained future-class logits to their stored
values: a departure clbench cannot reproduce without a head over every class from the start.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from clbench.config import require, require_choice
from clbench.data import Task
from clbench.methods.base import Logs, Replay
from clbench.methods.er import ER


@dataclass
class DERppConfig:
    alpha: float = 0.1  # weight of the logit MSE (mammoth best_args, seq-cifar10, buffer 200: 0.1)
    beta: float = 0.5  # weight of the replayed CE (same entry: 0.5); 0 is DER
    loss_scope: str = "seen"  # the current rows' CE: seen classes (mammoth) | task (L2P's code)
    freeze_backbone: bool = False

    def __post_init__(self) -> None:
        for key in ("alpha", "beta"):
            value = getattr(self, key)
            require(math.isfinite(value) and value >= 0, f"method.{key}", value, "a finite float >= 0")
        require_choice("method.loss_scope", self.loss_scope, ("seen", "task"))


class DERpp(ER):
    Config = DERppConfig
    replay_draws: ClassVar[int] = 2
    memory_logits: ClassVar[bool] = True

    def training_loss(
        self, x: torch.Tensor, y: torch.Tensor, task: Task, replay: tuple[Replay, ...] = ()
    ) -> tuple[torch.Tensor, Logs]:
        rows = [x, *(r.x for r in replay)]
        logits = self.seen_logits(self.features(torch.cat(rows), task.id))
        current = logits[: len(y)]
        self.stored_logits = current.detach().float()
        ce = self.current_ce(current, y, task).mean()
        if not replay:
            return ce, {}
        first, second = replay
        z1 = logits[len(y) : len(y) + len(first.y)].float()
        z2 = logits[len(y) + len(first.y) :]
        covered = torch.arange(z1.shape[1], device=z1.device)[None, :] < first.width[:, None]
        squared = (z1 - first.logits[:, : z1.shape[1]]).square() * covered
        mse = (squared.sum(1) / first.width).mean()  # each row over its stored width, then over the rows
        replayed_ce = F.cross_entropy(z2, second.y)
        loss = ce + self.config.alpha * mse + self.config.beta * replayed_ce
        return loss, {"logit_mse": mse.detach(), "replay_ce": replayed_ce.detach()}
