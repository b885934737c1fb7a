"""Metric formulas on hand-made accuracy matrices (R[i][j]: accuracy on task j after training task i), and the micro
ones through the evaluation of a hand-made prediction list."""

import contextlib
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from clbench import metrics, tracking
from clbench.config import DataConfig, LoggerConfig
from clbench.data import Benchmark, DeviceTransform, Split, Task
from clbench.evaluation import evaluate
from clbench.results import Results

N = None
# Accuracy on task 0 rises after task 1 (60 -> 70), then falls to 40: the two forgetting conventions differ.
R = [
    [60.0, N, N],
    [70.0, 80.0, N],
    [40.0, 50.0, 90.0],
]


def test_final_and_average_incremental_accuracy() -> None:
    assert metrics.final_acc(R) == pytest.approx((40 + 50 + 90) / 3)
    assert metrics.avg_incremental_acc(R) == pytest.approx((60 + (70 + 80) / 2 + (40 + 50 + 90) / 3) / 3)


def test_forgetting_chaudhry_takes_max_over_earlier_stages_only() -> None:
    # task 0: max(60, 70) - 40 = 30; task 1: 80 - 50 = 30
    assert metrics.forgetting(R) == pytest.approx(30.0)


def test_forgetting_conventions_differ_when_accuracy_rises() -> None:
    rising = [[50.0, N], [60.0, 90.0]]  # task 0 improves after task 1
    assert metrics.forgetting(rising) == pytest.approx(-10.0)  # Chaudhry: negative forgetting
    assert metrics.forgetting_l2p(rising) == pytest.approx(0.0)  # L2P code: max includes the last stage


def test_bwt_compares_final_row_with_diagonal() -> None:
    assert metrics.bwt(R) == pytest.approx(((40 - 60) + (50 - 80)) / 2)


def test_fwt_uses_accuracy_before_each_task_and_random_init() -> None:
    before = [N, 55.0, 30.0]
    random_init = [50.0, 50.0, 20.0]
    assert metrics.fwt(before, random_init) == pytest.approx(((55 - 50) + (30 - 20)) / 2)
    assert metrics.fwt(before, None) is None


def test_one_task_has_no_forgetting_bwt_or_fwt() -> None:
    one = [[75.0]]
    out = metrics.summary(one, [N], [50.0])
    assert out["final_acc"] == 75.0 and out["avg_incremental_acc"] == 75.0
    assert out["forgetting"] is None and out["forgetting_l2p"] is None
    assert out["bwt"] is None and out["fwt"] is None


def test_forgetting_matrix_entries() -> None:
    f = metrics.forgetting_matrix(R)
    assert np.isnan(f[0]).all()
    assert f[1, 0] == pytest.approx(60 - 70)
    assert f[2, 0] == pytest.approx(70 - 40)
    assert f[2, 1] == pytest.approx(80 - 50)
    assert math.isnan(f[1, 1]) and math.isnan(f[2, 2])
    assert metrics.to_nullable(f)[2] == [30.0, 30.0, None]


def test_metric_names_list_exactly_what_summary_computes() -> None:
    """``objective=`` is validated against ``metrics.NAMES``; it must name every metric summary() reports."""
    assert tuple(metrics.summary([[50.0]], [None], None)) == metrics.NAMES


def test_micro_accuracy_counts_every_seen_test_image_once() -> None:
    """Task sizes 100, 300, 100 (unequal): A_i = sum_j n_j R[i][j] / sum_j n_j over the seen tasks."""
    sizes = [100, 300, 100]
    a = [60.0, (70 * 100 + 80 * 300) / 400, (40 * 100 + 50 * 300 + 90 * 100) / 500]  # 60, 77.5, 56
    assert metrics.micro_accuracies(R, sizes) == pytest.approx(a)
    assert metrics.final_acc_micro(R, sizes) == pytest.approx(56.0)
    assert metrics.avg_incremental_acc_micro(R, sizes) == pytest.approx((60 + 77.5 + 56) / 3)
    equal = [100, 100, 100]  # equal tasks: micro = macro
    assert metrics.final_acc_micro(R, equal) == pytest.approx(metrics.final_acc(R))
    assert metrics.avg_incremental_acc_micro(R, equal) == pytest.approx(metrics.avg_incremental_acc(R))
    assert metrics.summary(R, [N, N, N], None)["final_acc_micro"] is None  # no image counts, no micro metric


class Scripted(torch.nn.Module):
    """A stand-in method predicting from a script: per stage, the global class of each test image, whose pixel value
    is its id. Logits are one-hot over the seen classes (two a task)."""

    task_conditioned = False

    def __init__(self, script: list[list[int]]) -> None:
        super().__init__()
        self.script, self.num_seen = script, 0

    def evaluating(self, task_id: int) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def predict_scenarios(self, x: torch.Tensor, task_id: int, scenarios: tuple, cil_classes: str) -> dict:
        ids = (x[:, 0, 0, 0] * 255).round().long().tolist()
        cil = F.one_hot(torch.tensor([self.script[self.num_seen - 1][i] for i in ids]), 2 * self.num_seen).float()
        return {"til": cil[:, 2 * task_id : 2 * task_id + 2], "cil": cil}


def hand_made_results() -> Results:
    """Task 0: 4 test images (labels 0, 0, 1, 1; ids 0-3), task 1: 2 (labels 2, 3; ids 4-5). After task 0 CIL
    predicts 0, 0, 1, 0: 3 of 4 right. After task 1: 0, 2, 3, 2 | 2, 3: task 0 1 of 4, task 1 2 of 2."""
    tasks = [Task(0, (0, 1), ("a", "b"), 0), Task(1, (2, 3), ("c", "d"), 2)]
    test = [
        Split(torch.arange(4, dtype=torch.uint8).view(4, 1, 1, 1).expand(4, 3, 1, 1), torch.tensor([0, 0, 1, 1])),
        Split(torch.arange(4, 6, dtype=torch.uint8).view(2, 1, 1, 1).expand(2, 3, 1, 1), torch.tensor([2, 3])),
    ]
    bench = Benchmark("hand-made", tasks, test, test)
    method = Scripted([[0, 0, 1, 0], [0, 2, 3, 2, 2, 3]])
    tf = DeviceTransform(DataConfig(name="d", source="digits", tasks=2, train_crop="none", hflip=False), 1,
                         (0.0,) * 3, (1.0,) * 3, train=False)  # fmt: skip
    results = Results({"method": "scripted", "benchmark": "hand-made"}, tasks, {"test": [4, 2]})
    for stage in (1, 2):
        method.num_seen = stage
        seen = list(range(stage))
        results.add_stage(evaluate(method, bench, seen, transform=tf, batch_size=8, autocast=contextlib.nullcontext()))
    return results


def test_micro_and_macro_differ_on_a_hand_made_prediction_list_with_unequal_tasks() -> None:
    """Macro (per-task means): final (25 + 100) / 2 = 62.5; average incremental (75 + 62.5) / 2 = 68.75.
    Micro (every image once): A_0 = 3/4 = 75, A_1 = (1 + 2) / 6 = 50: A_T = 50, Abar = (75 + 50) / 2 = 62.5."""
    results = hand_made_results()
    cil = results.metrics()["cil"]
    assert results.rows["cil"] == [[75.0, None], [25.0, 100.0]]
    assert (cil["final_acc"], cil["avg_incremental_acc"]) == pytest.approx((62.5, 68.75))
    assert (cil["final_acc_micro"], cil["avg_incremental_acc_micro"]) == pytest.approx((50.0, 62.5))
    assert [t["test_images"] for t in results.to_dict()["tasks"]] == [4, 2]


def test_the_summary_and_wandb_show_both_families_labelled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    results = hand_made_results()
    metrics_table = tracking.summary_tables(results)[-1]
    labels = list(metrics_table.columns[0].cells)
    cil = dict(zip(labels, metrics_table.columns[2].cells, strict=True))
    assert cil["final acc (mean over tasks)"] == "62.50" and cil["A_T (every image once)"] == "50.00"
    assert cil["avg incremental acc (mean over tasks)"] == "68.75" and cil["Ā (every image once)"] == "62.50"
    logged: dict = {}
    tracker = tracking.WandbTracker(LoggerConfig(mode="disabled"), tmp_path, {}, name=None)
    monkeypatch.setattr(tracker, "run", SimpleNamespace(log=lambda data, step: logged.update(data)), raising=False)
    monkeypatch.setattr(tracker, "_wandb", SimpleNamespace(Table=dict, Image=str), raising=False)
    results.diagnostics["task_confusion"] = {"cil": None}
    tracker.log_stage(results, tmp_path, step=0)
    assert logged["metrics/cil/final_acc_micro"] == pytest.approx(50.0) and logged["metrics/cil/final_acc"] == 62.5
    assert logged["metrics/cil/avg_incremental_acc_micro"] == pytest.approx(62.5)
