"""``smoke=true``: a run, a paper preset's on ViT-B included, taken end to end in a minute or two on a CPU, to see
that it starts, trains every phase of every task, evaluates and writes its folder before it goes to a GPU. Never a
result.

Every task keeps :data:`TRAIN_PER_CLASS` training images of each of its classes and its first :data:`TEST_PER_TASK`
test (and validation) image; every training phase stops after :data:`STEPS_PER_PHASE` step of a batch of
:data:`BATCH_SIZE` (the memory's draws too). The config, results.json and the summary say so; ``clbench-report``
and ``make table`` list such a run apart, never in a row. Measured on 2 CPU cores, the whole command: L2P Table 1's ER
row 90 s and its L2P row 83 s (ViT-B/16 at 224 px, 10 tasks of synthetic CIFAR-100), most of it ViT-B's steps.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the config's check imports this module: torch and the data only where a run samples
    from clbench.config import RunConfig
    from clbench.data import Benchmark, Split

TRAIN_PER_CLASS = 2  # two, so that a memory that holds a validation image out of each class (BiC) still trains
TEST_PER_TASK = 1  # evaluation is most of a smoke run's time: every seen task's test images after every task
STEPS_PER_PHASE = 1
BATCH_SIZE = 2  # even: mixup and cutmix pair the images of a batch
WARNING = (
    "SMOKE RUN (smoke=true): {train} training images of each class and {test} test image of each task, {steps} step "
    "of {batch} images a phase: it shows that the run goes end to end; its numbers are not results."
)


def described() -> dict[str, int]:
    """What a smoke run keeps: results.json's ``smoke``."""
    return {
        "train_images_per_class": TRAIN_PER_CLASS,
        "test_images_per_task": TEST_PER_TASK,
        "steps_per_phase": STEPS_PER_PHASE,
        "batch_size": BATCH_SIZE,
    }


def warning() -> str:
    return WARNING.format(train=TRAIN_PER_CLASS, test=TEST_PER_TASK, steps=STEPS_PER_PHASE, batch=BATCH_SIZE)


def shrunk(cfg: RunConfig) -> RunConfig:
    """A smoke run's config: the batches (the training batch, the memory's draws) at most :data:`BATCH_SIZE`."""
    trainer = dataclasses.replace(cfg.trainer, batch_size=min(cfg.trainer.batch_size, BATCH_SIZE))
    if not cfg.memory.active:
        return dataclasses.replace(cfg, trainer=trainer)
    memory = dataclasses.replace(cfg.memory, batch_size=min(cfg.memory.batch_size or BATCH_SIZE, BATCH_SIZE))
    return dataclasses.replace(cfg, trainer=trainer, memory=memory)


def first_of_each_class(split: Split, count: int) -> Split:
    """The first ``count`` images of each class of ``split``, in their stored order."""
    import numpy as np
    import torch

    from clbench.data import Split

    labels = split.y.cpu().numpy()
    kept = np.zeros(len(labels), dtype=bool)
    for label in np.unique(labels):
        kept[np.flatnonzero(labels == label)[:count]] = True
    mask = torch.from_numpy(kept)
    images = split.x[mask.to(split.x.device)] if isinstance(split.x, torch.Tensor) else split.x[mask]
    return Split(images, split.y[mask.to(split.y.device)])


def first(split: Split, count: int) -> Split:
    """The first ``count`` images of ``split``."""
    from clbench.data import Split

    return Split(split.x[:count], split.y[:count])


def sampled(benchmark: Benchmark) -> Benchmark:
    """The benchmark a smoke run trains and evaluates on: every task and class, a few images of each."""
    return dataclasses.replace(
        benchmark,
        train=[first_of_each_class(s, TRAIN_PER_CLASS) for s in benchmark.train],
        test=[first(s, TEST_PER_TASK) for s in benchmark.test],
        validation=[first(s, TEST_PER_TASK) for s in benchmark.validation],
    )


def header(cfg: RunConfig) -> dict[str, Any]:
    """results.json's ``smoke`` entry (absent from a real run's)."""
    return {"smoke": described()} if cfg.smoke else {}
