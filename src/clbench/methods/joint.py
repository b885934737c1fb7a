"""Joint: the upper-bound reference point. At task ``t`` it trains on the data of all tasks ``0..t`` at once
(continuing from the previous stage), so every row of its accuracy matrix is the joint-training bound for
the tasks seen so far and its last row is plain multi-class training on the whole benchmark.
"""

from __future__ import annotations

from dataclasses import dataclass

from clbench.data import Task
from clbench.methods.finetune import Finetune


@dataclass
class JointConfig:
    freeze_backbone: bool = False  # train only the heads (linear-probe upper bound)

    loss_scope = "seen"  # joint training always sees all classes


class Joint(Finetune):
    Config = JointConfig

    def train_task_ids(self, task: Task) -> list[int]:
        return list(range(task.id + 1))
