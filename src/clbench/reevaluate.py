"""`clbench-eval RUN_DIR`: evaluate a finished (or interrupted) run's tasks again from what it saved.

The run folder holds its config (``.hydra/config.yaml``) and ``method_artifacts.safetensors`` (heads, packed
masks, owner indices, and the backbone when the method changes it). The method is rebuilt from the config
and seed (so fixed weights, pretrained or seeded, come back the same), the artifacts are loaded, and every
saved task is evaluated in both scenarios and compared with the last row of ``results.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from omegaconf import OmegaConf
from rich.table import Table
from safetensors import SafetensorError
from safetensors.torch import load_file

from clbench.config import RunConfig, validate
from clbench.errors import ClbenchError, DataError
from clbench.evaluation import SCENARIOS


def load_run_config(run_dir: Path) -> RunConfig:
    path = run_dir / ".hydra" / "config.yaml"
    if not path.is_file():
        raise DataError(f"{run_dir} is not a clbench run folder: {path} is missing.")
    saved = OmegaConf.load(path)
    saved.objective = None  # what a sweep read of the run does not matter here (older runs named a test metric)
    return validate(saved)


def reevaluate(run_dir: Path, device: str | None = None) -> dict[str, list[float]]:
    """Accuracy (%) of every saved task, per scenario, recomputed from the run folder."""
    cfg = load_run_config(run_dir)
    path = run_dir / "method_artifacts.safetensors"
    try:
        tensors = load_file(path)
    except FileNotFoundError:
        raise DataError(f"{path} is missing: the run saved no task (it stopped before the first one ended).") from None
    except SafetensorError as err:
        raise DataError(f"{path} is corrupt ({err}); the run's tasks cannot be evaluated again.") from None
    if device is not None:
        cfg.trainer.device = device
    from clbench.loop.runtime import build_runtime  # torch and timm only once the folder is known to be usable

    method, rt = build_runtime(cfg)
    try:
        method.load_artifacts(tensors)
    except (KeyError, RuntimeError) as err:
        raise DataError(f"{path} does not fit the run's config ({err}).") from None
    return rt.evaluate(method, list(range(method.num_seen))).accuracy


def saved_row(run_dir: Path, stage: int) -> dict[str, list[float | None]] | None:
    """results.json's accuracies after training task ``stage`` (the stage the artifacts hold), or None where the
    file has no such row (a run stopped between writing the artifacts and results.json)."""
    path = run_dir / "results.json"
    if not path.is_file():
        return None
    try:
        matrices = json.loads(path.read_text())["acc_matrix"]
        rows = {s: matrices[s] for s in SCENARIOS}
    except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError) as err:
        raise DataError(f"{path} is corrupt ({type(err).__name__}: {err}); nothing to compare with.") from None
    if any(len(rows[s]) <= stage for s in SCENARIOS):
        return None
    return {s: rows[s][stage] for s in SCENARIOS}


def comparison_table(recomputed: dict[str, list[float]], saved: dict[str, list[float | None]] | None) -> Table:
    stage = len(recomputed["til"]) - 1
    table = Table(
        title=f"Accuracy (%) after task {stage} (the last saved): results.json vs. re-evaluated", title_justify="left"
    )
    table.add_column("task", justify="right")
    for s in SCENARIOS:
        table.add_column(f"{s.upper()} saved", justify="right")
        table.add_column(f"{s.upper()} now", justify="right")
    for j in range(stage + 1):
        cells = []
        for s in SCENARIOS:
            old = saved[s][j] if saved else None
            cells += ["-" if old is None else f"{old:.2f}", f"{recomputed[s][j]:.2f}"]
        table.add_row(str(j), *cells)
    return table


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="clbench-eval",
        description="Evaluate a clbench run's tasks again from its folder (config + method_artifacts.safetensors). "
        "Run it from the directory the run was started in, so relative data paths resolve the same way.",
    )
    parser.add_argument("run_dir", type=Path, help="the run folder, e.g. outputs/2026-11-22/10-00-00_meat_cifar100")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default=None, help="default: the run's own")
    parser.add_argument("--json", action="store_true", help="print the recomputed accuracies as JSON")
    args = parser.parse_args(argv)
    from clbench.tracking import console

    try:
        recomputed = reevaluate(args.run_dir, args.device)
        stage = len(recomputed["til"]) - 1
        saved = saved_row(args.run_dir, stage)
    except ClbenchError as err:
        print(f"clbench-eval: {err}", file=sys.stderr)
        sys.exit(2)
    if args.json:
        print(json.dumps(recomputed))
        return
    if saved is None:
        console.print(
            f"[yellow]results.json has no row after task {stage}, the stage method_artifacts.safetensors holds (the "
            "run stopped between writing the two): only the re-evaluated accuracies are shown.[/yellow]"
        )
    console.print(comparison_table(recomputed, saved))


if __name__ == "__main__":
    main()
