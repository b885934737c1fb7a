"""Whether a results.json's numbers can be put in a table: every value a finite number in its range, and every metric
the one its own accuracy matrices give (as ``clbench-eval`` checks a run's matrices against its saved model).

A file edited by hand, written by another tool or damaged on disk says so here, before ``clbench-report`` averages it
into a row. Free of torch: the report imports it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from clbench import metrics

SCENARIOS = ("til", "cil")
DIFFERENCES = ("forgetting", "bwt", "fwt")  # in [-100, 100]; every other metric is an accuracy, in [0, 100]
TOLERANCE = 1e-6  # percentage points: what two computations of one metric from one matrix may differ by (rounding)


def is_number(value: Any) -> bool:
    """A finite int or float (not a bool, NaN or infinity)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def matrix_problem(rows: Any, tasks: int, where: str) -> str | None:
    """What is wrong with an accuracy matrix of ``tasks`` rows: its shape, a value that is not a percentage, a cell
    above the diagonal that is set or one on or below it that is not."""
    if not isinstance(rows, list) or len(rows) != tasks or not all(isinstance(r, list) for r in rows):
        return f"{where} is not {tasks} rows (one per task trained)"
    for i, row in enumerate(rows):
        for j, value in enumerate(row):
            if j > i and value is not None:
                return f"{where}[{i}][{j}] is {value!r}: task {j} was not trained yet (null expected)"
            if j <= i and not (is_number(value) and 0 <= value <= 100):
                return f"{where}[{i}][{j}] is {value!r}, not an accuracy in [0, 100]"
        if len(row) < i + 1:
            return f"{where}[{i}] has {len(row)} values, not {i + 1} or more"
    return None


def metric_problem(name: str, value: Any, where: str) -> str | None:
    """A recorded metric that is not null or a finite number in its range."""
    if value is None:
        return None
    if not is_number(value):
        return f"{where} is {value!r}, not a number"
    low = -100 if name.startswith(DIFFERENCES) else 0
    return None if low <= value <= 100 else f"{where} is {value!r}, outside [{low}, 100]"


def scenario_list(run: Mapping[str, Any], key: str, scenario: str) -> Sequence[float | None] | None:
    """``run[key][scenario]`` (before_task_acc, random_init_acc) where it is a list, else None."""
    entry = run.get(key)
    found = entry.get(scenario) if isinstance(entry, Mapping) else None
    return found if isinstance(found, list) else None


def expected_metrics(run: Mapping[str, Any], scenario: str, rows: list[list[Any]]) -> dict[str, float | None]:
    """The metrics ``rows`` give (FWT only where the run recorded the accuracies it needs, the micro ones where it
    recorded each task's number of test images)."""
    stages = len(rows)
    square = [row[:stages] for row in rows]
    before = scenario_list(run, "before_task_acc", scenario)
    random = scenario_list(run, "random_init_acc", scenario)
    usable = before is not None and len(before) >= stages and all(is_number(v) for v in before[1:stages])
    fwt_inputs = usable and random is not None and len(random) >= stages and all(is_number(v) for v in random[:stages])
    tasks = run.get("tasks")
    counts = (
        [t.get("test_images") for t in tasks]
        if isinstance(tasks, list) and all(isinstance(t, Mapping) for t in tasks)
        else []
    )
    sizes = counts[:stages] if len(counts) >= stages and all(is_number(n) and n > 0 for n in counts) else None
    computed = metrics.summary(square, (before or [])[:stages], random[:stages] if fwt_inputs else None, sizes)
    if not fwt_inputs:
        computed.pop("fwt")
    if sizes is None:
        computed.pop("final_acc_micro")
        computed.pop("avg_incremental_acc_micro")
    return computed


def problem(run: Mapping[str, Any]) -> str | None:
    """Why a finished run's numbers cannot be reported (None when they can): a matrix or metric that is not a number
    in its range, or a metric its own matrix contradicts."""
    matrices, recorded = run.get("acc_matrix"), run.get("metrics")
    if not isinstance(matrices, Mapping) or not isinstance(recorded, Mapping):
        return "acc_matrix or metrics is not an object"
    tasks = run.get("tasks")
    for scenario in SCENARIOS:
        rows = matrices.get(scenario)
        count = len(tasks) if isinstance(tasks, list) else len(rows) if isinstance(rows, list) else 0
        wrong = matrix_problem(rows, count, f"acc_matrix.{scenario}")
        if wrong:
            return wrong
        values = recorded.get(scenario)
        if not isinstance(values, Mapping):
            return f"metrics.{scenario} is not an object"
        for name, value in values.items():
            wrong = metric_problem(name, value, f"metrics.{scenario}.{name}")
            if wrong:
                return wrong
        for name, value in expected_metrics(run, scenario, rows).items():
            if name not in values:
                continue  # an older results.json without this metric: nothing to contradict
            said = values[name]
            if (said is None) != (value is None) or (value is not None and abs(said - value) > TOLERANCE):
                shown = "null" if value is None else f"{value:.4f}"
                return f"metrics.{scenario}.{name} is {said!r}, but its acc_matrix gives {shown}"
    return None
