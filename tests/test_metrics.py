"""Metric formulas on hand-made accuracy matrices (R[i][j]: accuracy on task j after training task i)."""

import math

import numpy as np
import pytest

from clbench import metrics

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
