"""Where results go: the run folder (JSON, CSV, heatmap PNGs), the console (rich tables) and W&B."""

from __future__ import annotations

import csv
import io
import logging
import math
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch
from rich.console import Console
from rich.table import Table
from safetensors.torch import save as save_safetensors

from clbench.comparable import benchmark_label, method_name, setting_name
from clbench.config import LoggerConfig
from clbench.evaluation import SCENARIOS
from clbench.files import write_atomic
from clbench.metrics import stored_bits
from clbench.results import Results

log = logging.getLogger(__name__)
console = Console(stderr=True)

_SCENARIO_TITLES = {"til": "task-incremental (task id given)", "cil": "class-incremental (no task id)"}
_METRIC_LABELS = {
    "final_acc": "final acc (mean over tasks)",
    "avg_incremental_acc": "avg incremental acc (mean over tasks)",
    "final_acc_micro": "A_T (every image once)",
    "avg_incremental_acc_micro": "Ā (every image once)",
    "forgetting": "forgetting (Chaudhry)",
    "forgetting_l2p": "forgetting (L2P code)",
    "bwt": "BWT",
    "fwt": "FWT",
}


# --------------------------------------------------------------------------------------------- run folder
def matrix_csv(matrix: list[list[float | None]]) -> str:
    """Rows = after training task i, columns = evaluated task j; empty cells where undefined."""
    buf = io.StringIO()
    writer = csv.writer(buf)
    width = len(matrix[0]) if matrix else 0
    writer.writerow(["after_task", *[f"task_{j}" for j in range(width)]])
    for i, row in enumerate(matrix):
        writer.writerow([i, *["" if v is None else f"{v:.4f}" for v in row]])
    return buf.getvalue()


def draw_matrix(
    ax: plt.Axes, rows: list[list[float | None]], columns: int, cmap: str, limits: tuple[float, float], **labels: str
) -> None:
    """An annotated matrix on ``ax`` (None cells blank; the ink follows the cell's brightness); ``labels``: xlabel,
    ylabel and the colour bar's label."""
    grid = [[math.nan if v is None else v for v in row] for row in rows] or [[math.nan] * columns]
    im = ax.imshow(grid, cmap=cmap, vmin=limits[0], vmax=limits[1])
    for i, row in enumerate(rows):
        for j, v in enumerate(row):
            if v is not None:
                r, g, b, _ = im.cmap(im.norm(v))
                ink = "black" if 0.299 * r + 0.587 * g + 0.114 * b > 0.5 else "white"
                ax.text(j, i, f"{v:.0f}", ha="center", va="center", fontsize=7, color=ink)
    ax.set_xlabel(labels["xlabel"])
    ax.set_ylabel(labels["ylabel"])
    ax.set_xticks(range(columns))
    ax.set_yticks(range(len(grid)))
    ax.figure.colorbar(im, ax=ax, fraction=0.046, pad=0.04, label=labels.get("bar", ""))


def png(fig: plt.Figure, dpi: int = 120) -> bytes:
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    plt.close(fig)
    return buf.getvalue()


def heatmap_png(results: Results, scenario: str) -> bytes:
    """Accuracy and forgetting matrices of one scenario side by side, values annotated."""
    forgetting = results.forgetting_rows(scenario)
    spread = max([1.0] + [abs(v) for row in forgetting for v in row if v is not None])
    panels = [  # forgetting diverges around 0: red = forgotten, blue = improved since its best
        ("accuracy (%)", results.rows[scenario], "viridis", (0.0, 100.0)),
        ("forgetting (pp)", forgetting, "RdBu_r", (-spread, spread)),
    ]
    n = len(results.tasks)
    fig, axes = plt.subplots(1, 2, figsize=(2 + 1.1 * n, 1.2 + 0.55 * n), squeeze=False)
    for ax, (title, rows, cmap, limits) in zip(axes[0], panels, strict=True):
        draw_matrix(ax, rows, n, cmap, limits, xlabel="evaluated task", ylabel="after training task")
        ax.set_title(title, fontsize=9)
    fig.suptitle(f"{on_what(results)}: {_SCENARIO_TITLES[scenario]}", fontsize=10)
    return png(fig)


def on_what(results: Results) -> str:
    """``<method> on <benchmark>`` for a figure's title; the benchmark as the run measured it (``digits_5tasks_first3``
    where it kept 3 of its 5 tasks)."""
    return f"{results.header['method']} on {results.header['benchmark']}"


def task_confusion_png(results: Results) -> bytes:
    """The CIL task-confusion matrix after the latest task: row j = where task j's test samples were predicted (% in
    each task's classes). The diagonal is task inference done right; a heavy last column is recency bias."""
    rows = results.diagnostics["task_confusion"]["cil"]
    n = len(rows)
    fig, ax = plt.subplots(figsize=(1.6 + 0.6 * n, 1.2 + 0.55 * n))
    labels = {"xlabel": "predicted in the classes of task", "ylabel": "test samples of task"}
    draw_matrix(ax, rows, n, "Blues", (0.0, 100.0), **labels, bar="% of the task's samples")
    ax.set_title(f"{on_what(results)}: CIL task confusion", fontsize=9)
    return png(fig)


def prompt_histogram_png(histogram: dict[str, list[list[int]]], title: str) -> bytes:
    """A prompt method's selection counts (L2P's pool, DualPrompt's E-prompts), tasks x prompts, for training and for
    the latest evaluation side by side (pool collapse shows as the same few columns lit in every row)."""
    fig, axes = plt.subplots(1, len(histogram), figsize=(9, 2 + 0.35 * len(next(iter(histogram.values())))))
    for ax, (phase, rows) in zip(axes, histogram.items(), strict=True):
        im = ax.imshow(rows, cmap="magma", aspect="auto")
        ax.set_title(f"{phase}: selections per prompt", fontsize=9)
        ax.set_xlabel("prompt")
        ax.set_ylabel("task")
        fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04)
    fig.suptitle(title, fontsize=10)
    return png(fig, dpi=110)


def write_run_files(
    results: Results, run_dir: Path, *, heatmaps: bool = True, artifacts: dict[str, torch.Tensor] | None = None
) -> None:
    """results.json, the matrices as CSV, (optionally) the heatmaps and the method's tensors (safetensors);
    every file written atomically."""
    results.write(run_dir)
    if artifacts:
        write_atomic(run_dir / "method_artifacts.safetensors", save_safetensors(artifacts))
    for s in SCENARIOS:
        write_atomic(run_dir / f"acc_matrix_{s}.csv", matrix_csv(results.rows[s]))
        write_atomic(run_dir / f"forgetting_matrix_{s}.csv", matrix_csv(results.forgetting_rows(s)))
        if heatmaps:
            write_atomic(run_dir / f"heatmap_{s}.png", heatmap_png(results, s))
    if heatmaps and results.diagnostics.get("task_confusion", {}).get("cil"):
        write_atomic(run_dir / "task_confusion_cil.png", task_confusion_png(results))
    entries = [v for v in results.extra.values() if isinstance(v, dict) and "prompt_histogram" in v]
    histogram = entries[0]["prompt_histogram"] if entries else None
    if histogram and histogram["train"]:
        write_atomic(run_dir / "prompt_histogram.png", prompt_histogram_png(histogram, on_what(results)))


# --------------------------------------------------------------------------------------------- console
def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def summary_tables(results: Results) -> list[Table]:
    """The accuracy matrices (one per scenario) and a metrics table."""
    tables = []
    for s in SCENARIOS:
        table = Table(title=f"Accuracy (%), {_SCENARIO_TITLES[s]}", title_justify="left")
        table.add_column("after task", justify="right")
        for j in range(len(results.tasks)):
            table.add_column(f"T{j}", justify="right")
        for i, row in enumerate(results.rows[s]):
            table.add_row(str(i), *[_fmt(v) for v in row])
        tables.append(table)
    metrics = results.metrics()
    table = Table(title="Metrics (%)", title_justify="left")
    table.add_column("metric")
    for s in SCENARIOS:
        table.add_column(s.upper(), justify="right")
    for key, label in _METRIC_LABELS.items():
        table.add_row(label, *[_fmt(metrics.get(s, {}).get(key)) for s in SCENARIOS])
    tables.append(table)
    return tables + diagnostics_tables(results)


def diagnostics_tables(results: Results) -> list[Table]:
    """The method's own diagnostics (results.json ``method_diagnostics``): per training phase, the mean over its steps
    of each value its loss logs (MEAT's token keep ratio, EWC's penalty, ...); none for a method that logs none."""
    entries = results.method_diagnostics
    keys = list(dict.fromkeys(k for e in entries for k in e if k not in ("task", "phase", "steps")))
    if not keys:
        return []
    table = Table(title="Method diagnostics (mean over each phase's training steps)", title_justify="left")
    for column in ("task", "phase", "steps", *keys):
        table.add_column(column, justify="left" if column == "phase" else "right")
    for e in entries:
        values = ["-" if e.get(k) is None else f"{e[k]:.4g}" for k in keys]
        table.add_row(str(e["task"]), e["phase"], str(e["steps"]), *values)
    return [table]


def say(*objects: Any, terminal: bool = True) -> None:
    """Print to the terminal (stderr; unless ``terminal`` is false) and append the same text, without colour, to the
    run's log file (Hydra's clbench.log), so the log holds everything a run printed."""
    if terminal:
        console.print(*objects)
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler) and handler.stream is not None:
            Console(file=handler.stream, width=120, color_system=None, force_terminal=False).print(*objects)
            handler.flush()


def cost_line(cost: dict[str, Any]) -> str:
    """The test-time cost after a stage, in one line."""
    forwards, per_task, stored = cost["forwards_per_test_image"], cost["stored_bits_per_task"], stored_bits(cost)
    return (
        f"Test-time cost after task {cost['after_task']}: {forwards['til']} (TIL) / {forwards['cil']} (CIL) backbone "
        f"passes a test image; stored state {stored / 8e6:.3f} MB ({max(per_task, default=0) / 8e6:.3f} MB for the "
        f"largest task, {cost['shared_bits'] / 8e6:.3f} MB shared, {cost['memory_bits'] / 8e6:.3f} MB of memory)"
    )


def print_summary(results: Results, run_dir: Path) -> None:
    for table in summary_tables(results):
        say(table)
    if results.test_time_cost:
        say(cost_line(results.test_time_cost[-1]))
    say(
        f"[bold]Run folder:[/bold] {run_dir}  (results.json, CSVs, heatmap_til.png, heatmap_cil.png, "
        "task_confusion_cil.png)"
    )


# --------------------------------------------------------------------------------------------- W&B
class WandbTracker:
    """A thin W&B session; every call is a no-op when ``logger.mode=disabled``."""

    def __init__(
        self,
        cfg: LoggerConfig,
        run_dir: Path,
        config: dict[str, Any],
        *,
        name: str | None,
        run_id: str | None = None,
        weights_sha256: str | None = None,
    ) -> None:
        """``config``: the run's whole config (:func:`clbench.config.full_config`). Runs are grouped by it less the
        seed, the weights by their SHA-256 (``logger.group`` overrides), so W&B's grouping averages only comparable
        runs; tagged with method, benchmark and backbone. ``run_id``: continue that W&B run (a resumed clbench run
        keeps its W&B run)."""
        self.run = None
        if cfg.mode == "disabled":
            return
        import wandb

        self._wandb = wandb
        method = method_name(config["method"]["_target_"])
        benchmark, backbone = benchmark_label(config["data"]), config["backbone"]["name"]
        tags = [
            f"method:{method}",
            f"benchmark:{benchmark}",
            f"backbone:{backbone}",
            *(["smoke"] if config.get("smoke") else []),
        ]
        options = dict(
            project=cfg.project,
            entity=cfg.entity,
            dir=str(run_dir),
            config=config,
            group=cfg.group or setting_name(config, weights_sha256),
            name=cfg.name or name,
            tags=[*tags, *cfg.tags],
            id=run_id,
            resume="allow" if run_id else None,
        )
        settings = wandb.Settings(quiet=True, console="off", init_timeout=cfg.online_timeout)
        try:
            self.run = wandb.init(mode=cfg.mode, settings=settings, **options)
        except Exception as err:  # no network, no API key, server down: the run must not be lost to logging
            if cfg.mode != "online":
                raise
            say(
                f"[yellow]W&B online logging unavailable ({type(err).__name__}: {str(err).splitlines()[0][:200]}); "
                f"logging offline into {run_dir / 'wandb'} instead (upload later with `wandb sync`).[/yellow]"
            )
            self.run = wandb.init(mode="offline", settings=wandb.Settings(quiet=True, console="off"), **options)
        self.run.define_metric("task")
        for prefix in ("eval", "metrics", "top5", "validation", "validation_metrics"):  # plotted against the task
            self.run.define_metric(f"{prefix}/*", step_metric="task")

    @property
    def run_id(self) -> str | None:
        return self.run.id if self.run is not None else None

    def identity(self) -> dict[str, Any] | None:
        """The W&B run's id, project, group and name (recorded in results.json), or None when disabled."""
        if self.run is None:
            return None
        return {"id": self.run.id, "project": self.run.project, "group": self.run.group, "name": self.run.name}

    def log(self, data: dict[str, Any], step: int) -> None:
        if self.run is not None:
            self.run.log(data, step=step)

    def log_stage(self, results: Results, run_dir: Path, step: int) -> None:
        """Per-task accuracies (test, validation, top-5), the metrics so far, the matrices as tables and heatmaps,
        the CIL task confusion and the per-class accuracy; the summary keeps each metric's latest value, once."""
        if self.run is None:
            return
        wandb = self._wandb
        i = results.stages - 1
        data: dict[str, Any] = {"task": i}
        validation = results.metrics("validation")
        for s in SCENARIOS:
            for j, v in enumerate(results.rows[s][i][: i + 1]):
                data[f"eval/{s}/task_{j}"] = v
            for j, v in enumerate(results.diagnostics["top5_acc"][s]):
                if v is not None:
                    data[f"top5/{s}/task_{j}"] = v
            for key, v in results.metrics()[s].items():
                if v is not None:
                    data[f"metrics/{s}/{key}"] = v
            for j, v in enumerate(results.validation_rows[s][i][: i + 1] if results.validation_rows else []):
                data[f"validation/{s}/task_{j}"] = v
            for key, v in validation.get(s, {}).items():
                if v is not None:
                    data[f"validation_metrics/{s}/{key}"] = v
            columns = ["after_task", *[f"task_{j}" for j in range(len(results.tasks))]]
            data[f"acc_matrix/{s}"] = wandb.Table(
                columns=columns, data=[[k, *r] for k, r in enumerate(results.rows[s])]
            )
            data[f"forgetting_matrix/{s}"] = wandb.Table(
                columns=columns, data=[[k, *r] for k, r in enumerate(results.forgetting_rows(s))]
            )
            data[f"heatmap/{s}"] = wandb.Image(str(run_dir / f"heatmap_{s}.png"))
        confusion = results.diagnostics["task_confusion"]["cil"]
        if confusion:
            columns = ["task", *[f"in_task_{k}" for k in range(len(confusion))]]
            data["task_confusion/cil"] = wandb.Table(columns=columns, data=[[j, *r] for j, r in enumerate(confusion)])
            data["task_confusion/cil_heatmap"] = wandb.Image(str(run_dir / "task_confusion_cil.png"))
        names = [name for task in results.tasks[: i + 1] for name in task.class_names]
        per_class = results.diagnostics["per_class_acc"]
        rows = zip(names, *(per_class[s] for s in SCENARIOS), strict=True)
        data["per_class_acc"] = wandb.Table(columns=["class", *SCENARIOS], data=[list(row) for row in rows])
        if (run_dir / "prompt_histogram.png").is_file():
            data["l2p/prompt_histogram"] = wandb.Image(str(run_dir / "prompt_histogram.png"))
        self.run.log(data, step=step)

    def finish(self, results: Results, run_dir: Path, exit_code: int) -> None:
        """Mark the run's status, log the run folder's results (results.json, CSVs, PNGs, the method's tensors) as a
        W&B Artifact, and close the run."""
        if self.run is None:
            return
        self.run.summary["status"] = results.status
        if results.objective:
            self.run.summary["objective"] = results.objective["value"]
        artifact = self._wandb.Artifact(f"results-{self.run.id}", type="results", metadata={"status": results.status})
        for pattern in ("results.json", "*.csv", "*.png", "method_artifacts.safetensors"):
            for path in sorted(run_dir.glob(pattern)):
                artifact.add_file(str(path))
        self.run.log_artifact(artifact)
        self.run.finish(exit_code=exit_code)
