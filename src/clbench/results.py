"""The results.json contract (see README, "Results"): written atomically to the run folder after every task."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from clbench import metrics
from clbench.data import Task
from clbench.evaluation import SCENARIOS, Evaluation
from clbench.files import write_atomic


class Results:
    """Accuracy matrices and everything else results.json holds, filled in task by task."""

    def __init__(self, header: dict[str, Any], tasks: list[Task], sizes: dict[str, list[int]] | None = None) -> None:
        """``sizes``: each split's (test, validation) number of images per task, which the micro metrics weigh the
        tasks' accuracies by."""
        self.header = header
        self.tasks = tasks
        self.sizes = sizes or {}
        self.status = "running"
        self.failure: str | None = None
        t = len(tasks)
        self.rows: dict[str, list[list[float | None]]] = {s: [] for s in SCENARIOS}
        self.validation_rows: dict[str, list[list[float | None]]] | None = None  # with a validation split
        self.diagnostics: dict[str, Any] = {}  # the latest evaluation's top-5, per-class and task-confusion
        self.objective: dict[str, Any] | None = None
        self.before_task: dict[str, list[float | None]] = {s: [None] * t for s in SCENARIOS}
        self.random_init: dict[str, list[float]] | None = None
        self.timing: dict[str, list[float]] = {"train_s": [], "eval_s": [], "train_images_per_s": []}
        self.storage: dict[str, Any] = {}
        self.extra: dict[str, Any] = {}
        self.acceleration: dict[str, Any] = {}  # how the step ran: compiled, CUDA graphs, compile time, fallbacks
        # per training phase: {"task", "phase", and the scalars trained of each part (clbench.loop.trained_parts)}
        self.trained_parameters: list[dict[str, Any]] = []
        self.test_time_cost: list[dict[str, Any]] = []  # per stage: forwards per test image, the state stored
        # per training phase: {"task", "phase", "steps", and the mean of each value the method's loss logs}
        self.method_diagnostics: list[dict[str, Any]] = []

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps of the results (the rest comes from the config)."""
        return {
            "rows": self.rows,
            "validation_rows": self.validation_rows,
            "diagnostics": self.diagnostics,
            "before_task": self.before_task,
            "random_init": self.random_init,
            "timing": self.timing,
            "storage": self.storage,
            "extra": self.extra,
            "trained_parameters": self.trained_parameters,
            "test_time_cost": self.test_time_cost,
            "method_diagnostics": self.method_diagnostics,
        }

    def restore(self, state: dict[str, Any]) -> None:
        self.rows, self.before_task, self.random_init = state["rows"], state["before_task"], state["random_init"]
        self.validation_rows, self.diagnostics = state["validation_rows"], state["diagnostics"]
        self.timing, self.storage, self.extra = state["timing"], state["storage"], state["extra"]
        self.trained_parameters = state.get("trained_parameters", [])  # absent in a checkpoint written before it
        self.test_time_cost = state.get("test_time_cost", [])  # the same
        self.method_diagnostics = state.get("method_diagnostics", [])

    @property
    def stages(self) -> int:
        return len(self.rows["til"])

    def add_stage(self, test: Evaluation, validation: Evaluation | None = None) -> None:
        """Record what was measured after training task ``stages``: the rows of the accuracy matrices (test and,
        with a validation split, validation) and the test set's diagnostics."""
        t = len(self.tasks)
        if validation is not None and self.validation_rows is None:
            self.validation_rows = {s: [] for s in SCENARIOS}
        for rows, evaluation in ((self.rows, test), (self.validation_rows, validation)):
            if evaluation is not None and rows is not None:
                for s in SCENARIOS:
                    rows[s].append(evaluation.accuracy[s] + [None] * (t - len(evaluation.accuracy[s])))
        self.diagnostics = {
            "top5_acc": test.top5,
            "per_class_acc": test.per_class,
            "task_confusion": {"cil": test.task_confusion},
        }

    def metrics(self, split: str = "test") -> dict[str, dict[str, float | None]]:
        """Each scenario's metrics over the tasks trained so far. Validation has no FWT: it is not measured before
        a task starts."""
        rows = self.rows if split == "test" else self.validation_rows
        if self.stages == 0 or rows is None:
            return {}
        out = {}
        sizes = self.sizes.get(split)
        for s in SCENARIOS:
            square = [row[: self.stages] for row in rows[s]]
            if split == "test":
                rand = self.random_init[s][: self.stages] if self.random_init else None
                out[s] = metrics.summary(square, self.before_task[s][: self.stages], rand, sizes)
            else:
                out[s] = metrics.summary(square, [None] * self.stages, None, sizes)
        return out

    def objective_value(self, name: str) -> float | None:
        """``[validation.]<til|cil>.<metric>`` of the tasks trained so far (None where undefined)."""
        parsed = metrics.parse_objective(name)
        if parsed is None:
            raise ValueError(f"not an objective: {name!r}")
        split, scenario, metric = parsed
        return self.metrics(split).get(scenario, {}).get(metric)

    def forgetting_rows(self, scenario: str) -> list[list[float | None]]:
        t = len(self.tasks)
        f = metrics.to_nullable(metrics.forgetting_matrix(self.rows[scenario])) if self.stages else []
        return [row + [None] * (t - len(row)) for row in f]

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.header,
            "status": self.status,
            **({"failure": self.failure} if self.failure else {}),
            "tasks": [self.task_entry(t) for t in self.tasks],
            "acc_matrix": {s: self.rows[s] for s in SCENARIOS},
            "forgetting_matrix": {s: self.forgetting_rows(s) for s in SCENARIOS},
            "metrics": self.metrics(),
            "random_init_acc": self.random_init,
            "before_task_acc": self.before_task,
            **self.validation(),
            **self.diagnostics,
            **({"objective": self.objective} if self.objective else {}),
            "storage": self.storage,
            "trained_parameters": self.trained_parameters,
            "test_time_cost": self.test_time_cost,
            "method_diagnostics": self.method_diagnostics,
            "timing": self.timing,
            **({"acceleration": self.acceleration} if self.acceleration else {}),
            **self.extra,
        }

    def task_entry(self, task: Task) -> dict[str, Any]:
        """results.json's entry for ``task``: its classes and its number of images in each split."""
        counts = {f"{split}_images": sizes[task.id] for split, sizes in self.sizes.items()}
        return {"id": task.id, "classes": list(task.classes), "class_names": list(task.class_names), **counts}

    def record_cost(self, forwards: dict[str, int], storage: dict[str, Any]) -> None:
        """The test-time cost after the latest stage: backbone forwards one test image costs in each scenario, and
        the bits the method stores per seen task, shared by all, and in its rehearsal memory."""

        def bits(entry: dict[str, Any]) -> int:
            return int(sum(v for v in entry.values() if isinstance(v, int | float)))

        memory = storage.get("memory") or {}
        self.test_time_cost = [c for c in self.test_time_cost if c["after_task"] != self.stages - 1] + [
            {
                "after_task": self.stages - 1,
                "forwards_per_test_image": dict(forwards),
                "stored_bits_per_task": [bits(entry) for entry in storage.get("bits_per_task", [])],
                "shared_bits": bits(storage.get("shared_bits") or {}),
                "memory_bits": 8 * sum(v for k, v in memory.items() if k.startswith("bytes_")),
            }
        ]

    def record_trained(self, task: int, phase: str, counts: dict[str, int]) -> bool:
        """Keep what a phase trains (once: a resumed phase replaces its entry); whether it differs from the phase
        before (worth saying)."""
        entry = {"task": task, "phase": phase, **counts}
        kept = [e for e in self.trained_parameters if (e["task"], e["phase"]) != (task, phase)]
        changed = not kept or {k: v for k, v in kept[-1].items() if k not in ("task", "phase")} != counts
        self.trained_parameters = [*kept, entry]
        return changed

    def record_diagnostics(self, task: int, phase: str, steps: int, means: dict[str, float]) -> None:
        """Keep a training phase's diagnostics (once: a phase run again after a resume replaces its entry)."""
        kept = [e for e in self.method_diagnostics if (e["task"], e["phase"]) != (task, phase)]
        self.method_diagnostics = [*kept, {"task": task, "phase": phase, "steps": steps, **means}]

    def validation(self) -> dict[str, Any]:
        """results.json's ``validation`` entry, with a validation split."""
        if self.validation_rows is None:
            return {}
        return {"validation": {"acc_matrix": self.validation_rows, "metrics": self.metrics("validation")}}

    def write(self, run_dir: Path) -> Path:
        path = run_dir / "results.json"
        write_atomic(path, json.dumps(self.to_dict(), indent=2))
        return path
