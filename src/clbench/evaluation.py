"""Accuracy of every seen task, per sample, in both scenarios, counted with torchmetrics.

- TIL: the task id is given: ``predict(x, j)`` over task ``j``'s classes.
- CIL: no task id: ``predict(x, None)`` over all seen classes (task-conditioned methods infer the task); with
  ``cil_classes="all"`` over every class of the benchmark, those of the tasks not trained yet included (the official
  L2P and DualPrompt codes' argmax over their one head's every row).
Nothing in one test sample's prediction depends on the other samples of its batch (the model is in eval mode; a
method's batch-level rule, L2P's prompt vote, is an opt-in that results.json names), and no CIL prediction reads the
task id: both are tested for every method (:func:`scenario_logits`). The counts stay on the device until a task is
done; in a multi-process run each rank predicts its share of every batch and torchmetrics sums the counts over the
ranks.

Besides accuracy, what a reader needs when a method fails: top-5 accuracy where more than five classes compete,
per-class accuracy, and the CIL task-confusion matrix (row j: the share of task j's samples predicted in task k's
classes; recency bias shows as a heavy last column, task-inference errors as mass off the diagonal).
"""

from __future__ import annotations

import math
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
from torchmetrics import Metric
from torchmetrics.classification import MulticlassConfusionMatrix, MulticlassStatScores

from clbench.data import Benchmark, DeviceTransform
from clbench.distributed import Ranks
from clbench.methods import Method

SCENARIOS = ("til", "cil")


@dataclass
class Evaluation:
    """One evaluation of some tasks, in percent. Lists run over the evaluated tasks in order; ``per_class`` over
    their classes in global label order."""

    accuracy: dict[str, list[float | None]]
    top5: dict[str, list[float | None]]  # None where at most five classes compete
    per_class: dict[str, list[float | None]]
    task_confusion: list[list[float | None]] | None  # CIL; rows: evaluated tasks, columns: every seen task


def hit_counter(num_classes: int, device: torch.device, **kwargs: object) -> Metric:
    """Counts of hits (true positives) and misses (false negatives), micro or per class: accuracy is
    ``tp / (tp + fn)``, as torchmetrics' MulticlassAccuracy computes it, but from the integer counts in float64."""
    return MulticlassStatScores(num_classes, validate_args=False, **kwargs).to(device)


def percent(counter: Metric) -> list[float | None]:
    """Accuracy (%) from a :func:`hit_counter`; None for a class without samples."""
    scores = counter.compute().reshape(-1, 5).double()  # tp, fp, tn, fn, support
    tp, fn = scores[:, 0], scores[:, 3]
    return [None if n == 0 else 100.0 * hit / n for hit, n in zip(tp.tolist(), (tp + fn).tolist(), strict=True)]


@torch.no_grad()
def scenario_logits(
    method: Method, x: torch.Tensor, task_id: int, scenarios: tuple[str, ...], cil_classes: str = "seen"
) -> dict[str, torch.Tensor]:
    """What the evaluation counts for a batch ``x`` of task ``task_id``'s test images: the method's logits in each
    scenario (:meth:`~clbench.methods.Method.predict_scenarios` inside :meth:`~clbench.methods.Method.evaluating`).
    The task id is handed over for TIL and for the method's per-task diagnostics; no CIL logit may depend on it, nor
    any image's logits on the other images of ``x`` (tests/test_honest_evaluation.py checks both for every method)."""
    with method.evaluating(task_id):
        return method.predict_scenarios(x, task_id, scenarios, cil_classes)


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
    split: str = "test",
    cil_classes: str = "seen",
) -> Evaluation:
    """Evaluate ``task_ids`` on the benchmark's ``split`` (test or validation) in each scenario; ``cil_classes``:
    the classes CIL's argmax runs over, ``seen`` or ``all`` (see the module's docstring).

    CIL top-5 is left out (None) for task-conditioned methods: their CIL scores are -inf outside the inferred task,
    so a top-5 past that task's classes would rank ties."""
    was_training = method.training
    method.eval()
    seen = benchmark.tasks[: method.num_seen]
    scored = benchmark.tasks if cil_classes == "all" else seen  # the tasks whose classes CIL's argmax covers
    device = benchmark.test[0].y.device
    owner = torch.cat([torch.full((t.num_classes,), t.id, device=device) for t in scored])  # global label -> task
    widths = {"cil": len(owner)}
    out = Evaluation({s: [] for s in scenarios}, {s: [] for s in scenarios}, {s: [] for s in scenarios}, None)
    tasks = max(2, len(scored))  # torchmetrics needs two classes; with one seen task the second stays empty
    confusion = MulticlassConfusionMatrix(tasks, validate_args=False).to(device) if "cil" in scenarios else None
    for j in task_ids:
        task, data = benchmark.tasks[j], getattr(benchmark, split)[j]
        widths["til"] = task.num_classes
        counters = {}
        for s in scenarios:
            top5 = widths[s] > 5 and not (s == "cil" and method.task_conditioned)
            counters[s] = {
                "accuracy": hit_counter(widths[s], device, average="micro"),
                "per_class": hit_counter(widths[s], device, average="none"),
                **({"top5": hit_counter(widths[s], device, average="micro", top_k=5)} if top5 else {}),
            }
        for images, batch_labels in data.batches(batch_size, rows=ranks.rows()):
            part, weight = ranks.shard(len(batch_labels))
            if weight == 0:
                continue
            x, labels = transform(images, part), batch_labels[part]
            with autocast:
                logits = scenario_logits(method, x, j, scenarios, cil_classes)
            targets = {"til": labels - task.offset, "cil": labels}
            for s, scores in logits.items():
                as_float = scores.float()
                for metric in counters[s].values():
                    metric.update(as_float, targets[s])
            if confusion is not None:
                confusion.update(owner[logits["cil"].argmax(1)], torch.full_like(labels, j))
        for s in scenarios:
            out.accuracy[s] += percent(counters[s]["accuracy"])
            out.top5[s] += percent(counters[s]["top5"]) if "top5" in counters[s] else [None]
            classes = percent(counters[s]["per_class"])
            out.per_class[s] += classes if s == "til" else classes[task.offset : task.offset + task.num_classes]
    if confusion is not None:
        counts = confusion.compute()[task_ids].double()
        share = (100.0 * counts / counts.sum(1, keepdim=True))[:, : len(seen)]  # all classes: a row's rest is unseen
        out.task_confusion = [[None if math.isnan(v) else v for v in row] for row in share.tolist()]  # empty row
    method.train(was_training)
    return out
