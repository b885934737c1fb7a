"""Observe passes: the task's training images once, through the test transform, or (``Phase.augment``) through the
training transform, as a method's official code gathers its statistics (RanPAC and APER: the test transform; MIN:
augmented passes)."""

from __future__ import annotations

import pytest
import torch

from clbench.data import Task
from clbench.loop.runtime import build_runtime
from clbench.loop.task import run_task
from clbench.methods.base import Phase
from clbench.methods.simplecil import SimpleCIL
from conftest import tiny_config


class Recording(SimpleCIL):
    """SimpleCIL whose prototype pass is augmented when ``augment`` is set, and which keeps every batch it sees."""

    augment = False

    def phases(self, task: Task, epochs: int) -> list[Phase]:
        return [Phase("prototypes", 1, observe=True, augment=self.augment)]

    def observe(self, x: torch.Tensor, y: torch.Tensor, task: Task, rows: torch.Tensor) -> None:
        self.seen.append(x)
        super().observe(x, y, task, rows)


@pytest.mark.parametrize("augment", [False, True])
def test_an_observe_pass_sees_the_test_transform_or_with_augment_the_training_one(augment: bool) -> None:
    cfg = tiny_config("method=simplecil", "data.train_crop=pad", "data.hflip=true", "trainer.batch_size=64")
    built, rt = build_runtime(cfg)
    method = Recording(built.backbone, rt.benchmark, built.config)
    method.augment, method.seen = augment, []
    task = rt.benchmark.tasks[0]
    method.before_task(task)
    state = torch.get_rng_state()
    run_task(method, task, rt, epochs=1)
    raw = rt.benchmark.train[0].x
    (seen,) = method.seen
    assert torch.equal(seen, rt.test_tf(raw)) != augment
    torch.set_rng_state(state)
    assert torch.equal(seen, rt.train_tf(raw)) == augment  # the same draws, made for the whole batch
