"""Continual-learning metrics from an accuracy matrix, in percent.

``R[i][j]`` is the accuracy on task ``j`` after training task ``i`` (lower triangle; NaN above); ``n[j]`` is the
number of task ``j``'s test images. With T tasks:

- final_acc            = mean_j R[T-1][j]                                       per-task (macro) means: every task
- avg_incremental_acc  = mean_i mean_{j<=i} R[i][j]                             counts once (Protocol D's FAA, CAA)
- final_acc_micro      = A_T = A_{T-1}                                          Protocol P (PILOT): every seen test
- avg_incremental_acc_micro = Abar = mean_i A_i,                                image counts once; equal to the
                         A_i = sum_{j<=i} n[j] R[i][j] / sum_{j<=i} n[j]        macro ones when the tasks are equal
- forgetting           = mean_{j<T-1} ( max_{l<T-1} R[l][j] - R[T-1][j] )       Chaudhry et al., ECCV 2018
- forgetting_l2p       = mean_{j<T-1} ( max_{l<=T-1} R[l][j] - R[T-1][j] )      L2P/PILOT code: the max includes
                         the last stage, so each task's forgetting is clipped at 0
- bwt                  = mean_{j<T-1} ( R[T-1][j] - R[j][j] )                   Lopez-Paz & Ranzato, NeurIPS 2017
- fwt                  = mean_{j>0} ( P[j] - b[j] )                             same; P[j] = accuracy on task j after
                         task j-1 (measured when task j starts), b[j] = accuracy at random initialisation

Metrics that need two tasks are ``None`` with one task.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

Matrix = Sequence[Sequence[float | None]]


def as_array(matrix: Matrix) -> np.ndarray:
    """A (T, T) float array with NaN for missing (None) entries."""
    return np.array([[np.nan if v is None else float(v) for v in row] for row in matrix], dtype=float)


def to_nullable(array: np.ndarray) -> list[list[float | None]]:
    return [[None if np.isnan(v) else float(v) for v in row] for row in array]


def forgetting_matrix(matrix: Matrix) -> np.ndarray:
    """F[i][j] = max_{l<i} R[l][j] - R[i][j] for j < i; NaN elsewhere."""
    r = as_array(matrix)
    f = np.full_like(r, np.nan)
    for i in range(1, len(r)):
        for j in range(i):
            f[i, j] = np.nanmax(r[j:i, j]) - r[i, j]
    return f


def final_acc(matrix: Matrix) -> float:
    r = as_array(matrix)
    return float(np.mean(r[-1, : len(r)]))


def avg_incremental_acc(matrix: Matrix) -> float:
    r = as_array(matrix)
    return float(np.mean([np.mean(r[i, : i + 1]) for i in range(len(r))]))


def micro_accuracies(matrix: Matrix, sizes: Sequence[int]) -> list[float]:
    """A_i after each stage: the accuracy over every seen test image, each counted once (PILOT's
    ``accuracy()["total"]``): the per-task accuracies weighted by the tasks' test images."""
    r, n = as_array(matrix), np.asarray(sizes[: len(matrix)], dtype=float)
    return [float(np.dot(r[i, : i + 1], n[: i + 1]) / n[: i + 1].sum()) for i in range(len(r))]


def final_acc_micro(matrix: Matrix, sizes: Sequence[int]) -> float:
    return micro_accuracies(matrix, sizes)[-1]


def avg_incremental_acc_micro(matrix: Matrix, sizes: Sequence[int]) -> float:
    return float(np.mean(micro_accuracies(matrix, sizes)))


def forgetting(matrix: Matrix) -> float | None:
    r = as_array(matrix)
    t = len(r)
    if t < 2:
        return None
    return float(np.mean([np.max(r[: t - 1, j][j:]) - r[t - 1, j] for j in range(t - 1)]))


def forgetting_l2p(matrix: Matrix) -> float | None:
    r = as_array(matrix)
    t = len(r)
    if t < 2:
        return None
    return float(np.mean([np.max(r[j:t, j]) - r[t - 1, j] for j in range(t - 1)]))


def bwt(matrix: Matrix) -> float | None:
    r = as_array(matrix)
    t = len(r)
    if t < 2:
        return None
    return float(np.mean([r[t - 1, j] - r[j, j] for j in range(t - 1)]))


def fwt(before_task: Sequence[float | None], random_init: Sequence[float | None] | None) -> float | None:
    """Forward transfer from the accuracy on each task when it starts and at random initialisation."""
    if random_init is None or len(before_task) < 2:
        return None
    return float(np.mean([before_task[j] - random_init[j] for j in range(1, len(before_task))]))


NAMES = (  # summary()'s keys
    "final_acc",
    "avg_incremental_acc",
    "final_acc_micro",
    "avg_incremental_acc_micro",
    "forgetting",
    "forgetting_l2p",
    "bwt",
    "fwt",
)
ONE_TASK = ("final_acc", "avg_incremental_acc", "final_acc_micro", "avg_incremental_acc_micro")  # defined with 1 task


def summary(
    matrix: Matrix,
    before_task: Sequence[float | None],
    random_init: Sequence[float | None] | None,
    sizes: Sequence[int] | None = None,
) -> dict[str, float | None]:
    """All metrics of one scenario (TIL or CIL); the micro ones need the tasks' image counts (``sizes``)."""
    return {
        "final_acc": final_acc(matrix),
        "avg_incremental_acc": avg_incremental_acc(matrix),
        "final_acc_micro": final_acc_micro(matrix, sizes) if sizes is not None else None,
        "avg_incremental_acc_micro": avg_incremental_acc_micro(matrix, sizes) if sizes is not None else None,
        "forgetting": forgetting(matrix),
        "forgetting_l2p": forgetting_l2p(matrix),
        "bwt": bwt(matrix),
        "fwt": fwt(before_task, random_init),
    }


def stored_bits(cost: dict[str, Any]) -> int:
    """The whole state a method stores after a stage (an entry of results.json's ``test_time_cost``): every seen
    task's, the shared part and the rehearsal memory."""
    return int(sum(cost["stored_bits_per_task"]) + cost["shared_bits"] + cost["memory_bits"])


def parse_objective(name: str) -> tuple[str, str, str] | None:
    """``[validation.]<til|cil>.<metric>`` (a sweep's objective) as (split, scenario, metric), or None if it is not
    of that form."""
    parts = name.split(".")
    split, rest = ("validation", parts[1:]) if parts[0] == "validation" else ("test", parts)
    if len(rest) != 2 or rest[0] not in ("til", "cil") or rest[1] not in NAMES:
        return None
    return split, rest[0], rest[1]
