"""Accuracy of every seen task, per sample, in both scenarios.

- TIL: the task id is given: ``predict(x, j)`` over task ``j``'s classes.
- CIL: no task id: ``predict(x, None)`` over all seen classes (task-conditioned methods infer the task).
Nothing in one test sample's prediction depends on the other samples of its batch: the model is in eval
mode and ViTs have no batch statistics. Counts stay on the device until the task is done. In a multi-process
run each rank predicts its share of every batch and the counts are summed over ranks.
"""

from __future__ import annotations

from contextlib import AbstractContextManager

import torch

from clbench.data import Benchmark, DeviceTransform
from clbench.distributed import Ranks
from clbench.methods import Method

SCENARIOS = ("til", "cil")


@torch.no_grad()
def evaluate(
    method: Method,
    benchmark: Benchmark,
    task_ids: list[int],
    *,
    transform: DeviceTransform,
    batch_size: int,
    autocast: AbstractContextManager,
    scenarios: tuple[str, ...] = SCENARIOS,
    ranks: Ranks = Ranks(),  # noqa: B008 (frozen dataclass: the single process)
) -> dict[str, list[float]]:
    """Per-task accuracy (%) of ``task_ids`` in each scenario."""
    was_training = method.training
    method.eval()
    accuracy: dict[str, list[float]] = {s: [] for s in scenarios}
    for j in task_ids:
        task, split = benchmark.tasks[j], benchmark.test[j]
        correct = {s: torch.zeros((), dtype=torch.long, device=split.y.device) for s in scenarios}
        for images, batch_labels in split.batches(batch_size, shuffle=False):
            part, weight = ranks.shard(len(batch_labels))
            if weight == 0:
                continue
            x, labels = transform(images, part), batch_labels[part]
            with autocast, method.evaluating(j):
                logits = method.predict_scenarios(x, j, scenarios)
            if "til" in logits:
                correct["til"] += (logits["til"].argmax(1) + task.offset == labels).sum()
            if "cil" in logits:
                correct["cil"] += (logits["cil"].argmax(1) == labels).sum()
        for s in scenarios:
            accuracy[s].append(100.0 * ranks.sum_(correct[s]).item() / len(split))
    method.train(was_training)
    return accuracy
