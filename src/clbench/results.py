"""The results.json contract (see README, "Results"): written atomically to the run folder after every task."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from clbench import metrics
from clbench.data import Task
from clbench.evaluation import SCENARIOS
from clbench.files import write_atomic


class Results:
    """Accuracy matrices and everything else results.json holds, filled in task by task."""

    def __init__(self, header: dict[str, Any], tasks: list[Task]) -> None:
        self.header = header
        self.tasks = tasks
        self.status = "running"
        self.failure: str | None = None
        t = len(tasks)
        self.rows: dict[str, list[list[float | None]]] = {s: [] for s in SCENARIOS}
        self.before_task: dict[str, list[float | None]] = {s: [None] * t for s in SCENARIOS}
        self.random_init: dict[str, list[float]] | None = None
        self.timing: dict[str, list[float]] = {"train_s": [], "eval_s": [], "train_images_per_s": []}
        self.storage: dict[str, Any] = {}
        self.extra: dict[str, Any] = {}

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps of the results (the rest comes from the config)."""
        return {
            "rows": self.rows,
            "before_task": self.before_task,
            "random_init": self.random_init,
            "timing": self.timing,
            "storage": self.storage,
            "extra": self.extra,
        }

    def restore(self, state: dict[str, Any]) -> None:
        self.rows, self.before_task, self.random_init = state["rows"], state["before_task"], state["random_init"]
        self.timing, self.storage, self.extra = state["timing"], state["storage"], state["extra"]

    @property
    def stages(self) -> int:
        return len(self.rows["til"])

    def add_stage(self, accuracy: dict[str, list[float]]) -> None:
        """Record the row of accuracies measured after training task ``stages``."""
        t = len(self.tasks)
        for s in SCENARIOS:
            row = list(accuracy[s])
            self.rows[s].append(row + [None] * (t - len(row)))

    def square(self, scenario: str) -> list[list[float | None]]:
        """The matrix over the tasks trained so far (the metrics treat it as the whole run so far)."""
        k = self.stages
        return [row[:k] for row in self.rows[scenario]]

    def metrics(self) -> dict[str, dict[str, float | None]]:
        if self.stages == 0:
            return {}
        out = {}
        for s in SCENARIOS:
            rand = self.random_init[s][: self.stages] if self.random_init else None
            out[s] = metrics.summary(self.square(s), self.before_task[s][: self.stages], rand)
        return out

    def forgetting_rows(self, scenario: str) -> list[list[float | None]]:
        t = len(self.tasks)
        f = metrics.to_nullable(metrics.forgetting_matrix(self.rows[scenario])) if self.stages else []
        return [row + [None] * (t - len(row)) for row in f]

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.header,
            "status": self.status,
            **({"failure": self.failure} if self.failure else {}),
            "tasks": [{"id": t.id, "classes": list(t.classes), "class_names": list(t.class_names)} for t in self.tasks],
            "acc_matrix": {s: self.rows[s] for s in SCENARIOS},
            "forgetting_matrix": {s: self.forgetting_rows(s) for s in SCENARIOS},
            "metrics": self.metrics(),
            "random_init_acc": self.random_init,
            "before_task_acc": self.before_task,
            "storage": self.storage,
            "timing": self.timing,
            **self.extra,
        }

    def write(self, run_dir: Path) -> Path:
        path = run_dir / "results.json"
        write_atomic(path, json.dumps(self.to_dict(), indent=2))
        return path
