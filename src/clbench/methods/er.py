"""ER, experience replay (Chaudhry et al. 2019, "On Tiny Episodic Memories in Continual Learning"; as mammoth's
``er.py``, the reference code L2P's Table 1 and DER++ compare with): fine-tuning whose every step also trains on a
batch drawn from a rehearsal memory.

Each step: the current batch (B images) and M images drawn uniformly from the memory (without replacement; augmented
like the current batch) go through the model together; the loss is the mean cross-entropy over the B + M rows (not the
mean of two means); after the optimizer step the current batch is offered to the reservoir (its un-augmented images
and labels). ``loss_scope=seen``: every row over the seen classes (mammoth's rule, over seen rather than all classes);
``task``: the current rows over their task's classes, the memory rows over the seen classes (L2P's code with
``replay_no_mask``). Either way every seen head trains: the replayed rows' cross-entropy reaches the earlier tasks'
heads, as it reaches the one head over all classes of mammoth's and L2P's codes.

Departures from mammoth's ``er.py``, stated: the loss covers the seen classes, not every class of the benchmark
(clbench's heads grow); an epoch's last, smaller batch is joined by proportionally fewer memory images (mammoth draws
``minibatch_size`` whatever the batch), so that every rank of a multi-process run holds the same share of current and
memory rows and the averaged gradients are the whole batch's; a memory holding fewer images than a draw asks for
repeats some (mammoth returns fewer rows), so that every step has one shape (a CUDA graph replays it).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from clbench.data import Task
from clbench.methods.base import Logs, Phase, Replay
from clbench.methods.finetune import Finetune


class ER(Finetune):
    memory_sampler: ClassVar[str | None] = "reservoir"
    needs_memory: ClassVar[bool] = True
    replay_draws: ClassVar[int] = 1

    def param_groups(self, task: Task, phase: Phase) -> list[dict[str, Any]]:
        """The backbone (unless frozen) and every seen head, whatever ``loss_scope``: the replayed rows train the
        earlier heads (finetune's ``loss_scope=task`` keeps them out)."""
        self.backbone.requires_grad_(not self.config.freeze_backbone)
        self.heads.requires_grad_(True)
        return [{"params": [p for p in self.parameters() if p.requires_grad]}]

    def training_loss(
        self, x: torch.Tensor, y: torch.Tensor, task: Task, replay: tuple[Replay, ...] = ()
    ) -> tuple[torch.Tensor, Logs]:
        if not replay:
            return super().training_loss(x, y, task)
        memory = replay[0]
        logits = self.seen_logits(self.features(torch.cat([x, memory.x]), task.id))
        current, replayed = logits[: len(y)], logits[len(y) :]
        per_row = torch.cat([self.current_ce(current, y, task), F.cross_entropy(replayed, memory.y, reduction="none")])
        return per_row.mean(), {}

    def current_ce(self, logits: torch.Tensor, y: torch.Tensor, task: Task) -> torch.Tensor:
        """Per-row cross-entropy of the current rows: over the seen classes, or (``loss_scope=task``) over the task's
        own (the other logits masked out)."""
        if self.config.loss_scope == "task":
            return F.cross_entropy(
                logits[:, task.offset : task.offset + task.num_classes], y - task.offset, reduction="none"
            )
        return F.cross_entropy(logits, y, reduction="none")

    def takes_soft_targets(self) -> bool:
        return False  # the replayed rows' hard labels and the current rows' mixed ones do not mix
