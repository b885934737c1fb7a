"""The run, top to bottom: every method, benchmark and backbone goes through :func:`train`.

train(cfg, run_dir)
  lock the run folder, load its checkpoint when resuming
  build_runtime: device, data, backbone, method, transforms, how the step runs      (loop/runtime.py)
  accuracy of the untrained method on every task (b_j, for FWT)
  for each task:
    method.before_task; accuracy on the new task before training it
    run_task: the method's phases -> epochs -> steps                                  (loop/task.py, loop/step.py)
    method.after_task
    evaluate every seen task (TIL and CIL; validation too) -> results.json, checkpoint, W&B
  summary
"""

from __future__ import annotations

import copy
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from clbench import __version__, checkpoint, distributed, smoke
from clbench.backbones import input_stats, sha256, weights_file
from clbench.checkpoint import Cursor, Position
from clbench.comparable import benchmark_label, method_name
from clbench.config import RunConfig, as_dict, full_config
from clbench.data import Benchmark, Task
from clbench.errors import DataError, Preempted
from clbench.files import (
    RESULTS_FILE,
    begin_writing,
    check_new_run,
    check_writable,
    lock_run_folder,
    remove_stale_temporaries,
    unlock_run_folder,
)
from clbench.loop.resume import Saved, check_identity, finish_untrained, identity, restore
from clbench.loop.runtime import Runtime, build_runtime, describe
from clbench.loop.signals import stop_signals
from clbench.loop.task import Hooks, run_task
from clbench.loop.trained_parts import describe_counts
from clbench.methods import Method
from clbench.methods.base import Phase
from clbench.prerequisites import check_prerequisites
from clbench.provenance import git_state, versions
from clbench.results import Results
from clbench.tracking import WandbTracker, console, print_summary, say, write_run_files


def train(cfg: RunConfig, run_dir: Path, *, name: str | None = None) -> Results:
    """Run the whole experiment described by ``cfg``; results land in ``run_dir`` after every task. With
    ``cfg.resume`` (true, or auto where a checkpoint exists) it continues from ``run_dir``'s checkpoint and ends
    with the same results as an uninterrupted run. In a multi-process run (torchrun) every rank trains and
    evaluates its share; only rank 0 writes the folder, the checkpoints and W&B."""
    check_prerequisites(cfg.data, cfg.backbone)
    main = distributed.current().is_main
    if main:
        check_new_run(run_dir, cfg.resume)  # a run is never written over another
    resuming = cfg.resume is True or (cfg.resume == "auto" and (run_dir / checkpoint.FILE).exists())
    # The checkpoint is loaded once, here: a missing, corrupt or foreign one is reported before the folder is touched
    # or anything is built.
    saved = checkpoint.load(run_dir) if resuming else None
    harmless = check_identity(cfg, run_dir, saved[1]) if saved is not None else []
    if saved is not None and finished(saved[1]):
        say(f"clbench: {run_dir} holds a finished run: nothing to resume, and nothing in it is written")
        return recorded(cfg, run_dir, saved[1])
    if main:
        check_writable(run_dir)
    acquired = main and lock_run_folder(run_dir)
    try:
        return train_in_folder(cfg, run_dir, name, main, saved, harmless=harmless)
    finally:
        if acquired:
            unlock_run_folder(run_dir)


def finished(state: dict[str, Any]) -> bool:
    """Whether a checkpoint is a finished run's: every task trained and evaluated, no task in progress."""
    rows = state["results"]["rows"]["til"]
    return state["position"]["cursor"] is None and bool(rows) and len(rows) == len(rows[0])


def recorded(cfg: RunConfig, run_dir: Path, state: dict[str, Any]) -> Results:
    """A finished run's results as its checkpoint holds them (its tasks from its results.json); nothing is built or
    written."""
    try:
        tasks = json.loads((run_dir / RESULTS_FILE).read_text())["tasks"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise DataError(f"{run_dir} holds a finished run whose results.json cannot be read ({err}).") from None
    offsets = np.cumsum([0, *(len(t["classes"]) for t in tasks)])
    sizes = {
        s: [t[f"{s}_images"] for t in tasks] for s in ("test", "validation") if all(f"{s}_images" in t for t in tasks)
    }
    results = Results(header(cfg), [Task(t["id"], tuple(t["classes"]), tuple(t["class_names"]), int(offsets[i]))
                                    for i, t in enumerate(tasks)], sizes)  # fmt: skip
    results.restore(state["results"])
    results.status = "finished"
    if cfg.objective is not None:
        results.objective = {"name": cfg.objective, "value": results.objective_value(cfg.objective)}
    return results


def resuming_line(run_dir: Path, position: Position, tasks: int, harmless: list[str]) -> str:
    """What a resumed run says first: the folder, where its checkpoint stands (tasks, phases and epochs counted from
    0, as the stop message counts them), and any changed settings that cannot change its results."""
    cursor = position.cursor
    if cursor is not None:
        batches = f"{cursor.batch} batch{'' if cursor.batch == 1 else 'es'}"
        where = f"in task {position.task} of {tasks} (phase {cursor.phase}, epoch {cursor.epoch}, after {batches}"
        where += f" of it; step {position.step})"
    elif position.task < tasks:
        where = f"at the start of task {position.task} of {tasks} (step {position.step})"
    else:
        where = f"after its last task ({tasks} of {tasks}: nothing left to train)"
    changed = f"; with {'; '.join(harmless)} (settings that do not change the results)" if harmless else ""
    return f"clbench: resumed {run_dir} from its checkpoint, {where}{changed}"


def train_in_folder(
    cfg: RunConfig, run_dir: Path, name: str | None, main: bool, saved: Saved | None, *, harmless: list[str]
) -> Results:
    """:func:`train` once the run folder is held; ``saved``: the checkpoint it resumes from (``harmless``: the changed
    settings that cannot change its results). A run refused while its method and data are built (a value only the
    built model can check, missing data) or its checkpoint is loaded into them (values that do not fit) has not begun
    to write the folder: the CLI gives it back as it was."""
    method, rt = build_runtime(cfg)
    results = Results(header(cfg), rt.benchmark.tasks, image_counts(rt.benchmark))
    loaded = start_record(cfg, method, rt, results, main)
    position, wandb_id = Position(0, 0), None
    if saved is not None:  # a checkpoint that does not fit the run its config builds is refused here too
        position, wandb_id = restore(cfg, saved, method, rt.benchmark.tasks, results, path=run_dir / checkpoint.FILE)
        if main:
            say(resuming_line(run_dir, saved[0], cfg.data.num_tasks or cfg.data.tasks, harmless))
    if main:
        begin_writing(run_dir)
        remove_stale_temporaries(run_dir)
    logger = cfg.logger if main else dataclasses.replace(cfg.logger, mode="disabled")
    weights = results.header["backbone_config"]["weights_sha256"]
    tracker = WandbTracker(
        logger, run_dir, results.header["config"], name=name, run_id=wandb_id, weights_sha256=weights
    )
    results.header["wandb"] = tracker.identity()
    if main:
        for line in describe(cfg, method, rt, loaded):
            say(line)
    exit_code = 1
    try:
        if cfg.trainer.eval_random_init and saved is None:
            results.random_init = measure_random_init(method, rt)
        train_tasks(method, rt, results, tracker=tracker, run_dir=run_dir, position=position, main=main)
        results.status = "finished"
        if cfg.objective is not None:
            results.objective = {"name": cfg.objective, "value": results.objective_value(cfg.objective)}
        exit_code = 0
    except Preempted as err:
        results.status = "interrupted"
        results.failure = f"{err}; resume with the same command and resume=true"
        raise
    except BaseException as err:
        results.status = "failed"
        results.failure = f"{type(err).__name__}: {err}"
        raise
    finally:
        results.acceleration |= dataclasses.asdict(rt.log)
        if main:
            write_run_files(results, run_dir, heatmaps=results.stages > 0)
        tracker.finish(results, run_dir, exit_code)
    if main:
        print_summary(results, run_dir)
        if cfg.smoke:
            say(f"[bold yellow]{smoke.warning()}[/bold yellow]")
        if rt.log.compiled_graphs:
            log = rt.log
            say(f"torch.compile: {log.compiled_graphs} graphs, {log.compile_s:.1f} s in the steps that compiled them")
    return results


def train_tasks(
    method: Method,
    rt: Runtime,
    results: Results,
    *,
    tracker: WandbTracker,
    run_dir: Path,
    position: Position,
    main: bool,
) -> None:
    """Every task from ``position`` on: start it, train it, finish it, evaluate and record; a checkpoint after each."""
    cfg = rt.cfg

    def save(task_id: int, cursor: Cursor | None, step: int) -> None:
        if main:
            payload = {
                "identity": identity(cfg),
                "method": method.state_dict(),
                "results": results.state(),
                "wandb_id": tracker.run_id,
            }
            checkpoint.save(run_dir, Position(task_id, step, cursor), payload)

    def diagnosed(task: Task, phase: Phase, steps: int, means: dict[str, float]) -> None:
        results.record_diagnostics(task.id, phase.name, steps, means)

    def trains(task: Task, phase: Phase, counts: dict[str, int]) -> None:
        if results.record_trained(task.id, phase.name, counts) and main:
            say(f"task {task.id}, phase {phase.name}: trains {describe_counts(counts)}")

    step = position.step
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    bars = Progress(*columns, TimeRemainingColumn(), console=console, transient=True, disable=not main)
    with bars as progress, stop_signals() as stop:
        for task in rt.benchmark.tasks[position.task :]:
            cursor = position.cursor if task.id == position.task else None
            if cursor is None:
                start_task(method, task, rt, results)
            start = time.perf_counter()
            hooks = Hooks(tracker, progress, lambda c, s, t=task.id: save(t, c, s), stop, trains, diagnosed)
            step, images = run_task(method, task, rt, epochs=cfg.trainer.epochs, step=step, cursor=cursor, hooks=hooks)
            method.after_task(task)
            if rt.device.type == "cuda":
                torch.cuda.synchronize()
            train_s = time.perf_counter() - start
            eval_s = record_task(method, task, rt, results)
            results.timing["train_s"].append(round(train_s, 3))
            results.timing["eval_s"].append(round(eval_s, 3))
            results.timing["train_images_per_s"].append(round(images / train_s, 1) if train_s > 0 else None)
            if main:
                write_run_files(
                    results, run_dir, artifacts={k: v.cpu().contiguous() for k, v in method.artifacts().items()}
                )
            save(task.id + 1, None, step)
            if main:
                tracker.log_stage(results, run_dir, step)
                say(stage_line(results, task, train_s, eval_s))


def start_task(method: Method, task: Task, rt: Runtime, results: Results) -> None:
    """``before_task`` (the new head, masks, pools), then the new task's TIL accuracy before training it (FWT's
    R[j-1][j]; its CIL accuracy is 0: no guess can hit classes not yet seen)."""
    method.before_task(task)
    if method.memory is not None:
        method.memory.start_task(task, rt.benchmark.train[task.id].y.cpu())
    if task.id > 0:
        before = rt.evaluate(method, [task.id], ("til",))
        results.before_task["til"][task.id] = before.accuracy["til"][0]
        results.before_task["cil"][task.id] = 0.0


def record_task(method: Method, task: Task, rt: Runtime, results: Results) -> float:
    """Evaluate every seen task (test, and validation where held out) into ``results``; returns the seconds it took."""
    start = time.perf_counter()
    seen = list(range(task.id + 1))
    validation = rt.evaluate(method, seen, split="validation") if rt.benchmark.validation else None
    results.add_stage(rt.evaluate(method, seen), validation)
    results.storage = method.storage()
    if method.memory is not None:
        results.storage["memory"] = method.memory.storage()
    results.record_cost(method.forwards_per_test_image(), results.storage)
    results.extra = method.extra_results()
    return time.perf_counter() - start


def stage_line(results: Results, task: Task, train_s: float, eval_s: float) -> str:
    row = results.rows
    return (
        f"task {task.id}: TIL {row['til'][-1][task.id]:.1f}% / CIL {row['cil'][-1][task.id]:.1f}% on it; "
        f"mean over seen tasks TIL {np.mean(row['til'][-1][: task.id + 1]):.1f}% "
        f"CIL {np.mean(row['cil'][-1][: task.id + 1]):.1f}%  ({train_s:.1f}s train, {eval_s:.1f}s eval)"
    )


def measure_random_init(method: Method, rt: Runtime) -> dict[str, list[float]]:
    """b_j for FWT: a copy of the untouched method goes through the protocol without a training step (also no
    PackNet retraining); task j is evaluated right after its ``before_task`` (fresh head), as in the real run."""
    probe = copy.deepcopy(method)
    acc: dict[str, list[float]] = {"til": [], "cil": []}
    with torch.random.fork_rng(devices=[rt.device] if rt.device.type == "cuda" else []):
        for task in rt.benchmark.tasks:
            probe.before_task(task)
            for s, values in rt.evaluate(probe, [task.id]).accuracy.items():
                acc[s] += values
            finish_untrained(probe, task)
    return acc


def image_counts(benchmark: Benchmark) -> dict[str, list[int]]:
    """Each split's number of images per task (test, and validation where held out)."""
    splits = {"test": benchmark.test, "validation": benchmark.validation}
    return {name: [len(split) for split in data] for name, data in splits.items() if data}


def header(cfg: RunConfig) -> dict[str, Any]:
    return {
        "clbench_version": __version__,
        "method": method_name(cfg.method_target),
        "backbone": cfg.backbone.name,
        "benchmark": benchmark_label(as_dict(cfg.data)),  # digits_5tasks_first3 where only 3 of its tasks ran
        "protocol": cfg.data.protocol,
        "seed": cfg.seed,
        "class_order_seed": cfg.data.class_order_seed,
        "method_config": as_dict(cfg.method),
        "backbone_config": as_dict(cfg.backbone),
        "config": full_config(cfg),
        **smoke.header(cfg),  # smoke=true: what it kept; clbench-report and make table list such a run apart
    }


def start_record(cfg: RunConfig, method: Method, rt: Runtime, results: Results, main: bool) -> Path | None:
    """What results.json records before training (device, versions and commit, the weights file and its SHA-256, the
    seeded data splits, how the step runs, whether the evaluation is per sample); warns where a frozen-backbone method
    would learn over random features, and where a batch-level option makes a prediction depend on its batch.
    Returns the loaded weights file."""
    results.header["device"] = str(rt.device)
    results.header["versions"] = versions(rt.device)
    results.header["git_commit"], results.header["git_dirty"] = git_state()
    # A method rebuilt from its principle where its paper's equations could not be read (TFM, KSM): never cite its
    # numbers as the paper's.
    results.header["reconstructed"] = method.reconstructed
    loaded = weights_file(cfg.backbone, method.backbone)
    mean, std = input_stats(method.backbone, cfg.backbone)
    results.header["backbone_config"] |= {
        "weights_file": str(loaded) if loaded else None,
        "weights_sha256": sha256(loaded) if loaded else None,  # two runs on different weights never look alike
        "timm_tag": (method.backbone.pretrained_cfg or {}).get("tag"),  # the tag timm built it with (stats, weights)
        "input_mean": list(mean),  # what the pixels in [0, 1] are normalised with (0 and 1: not at all)
        "input_std": list(std),
    }
    if rt.benchmark.splits:
        results.header["data_splits"] = rt.benchmark.splits
    batch_level = method.batch_level(method.config)  # an official code's batch-level rule, turned on by the run
    results.header["evaluation"] = {"per_sample": not batch_level, "batch_level": batch_level}
    if main and batch_level:
        say(
            f"[yellow]warning: {', '.join(batch_level)}: a test image's prediction depends on the other images of its "
            "batch (each batch holds one task's images), so the numbers are not the per-sample protocol's.[/yellow]"
        )
    results.acceleration = {"compile": rt.accel.compile, "cuda_graphs": rt.accel.graphs}
    if main and not method.changes_backbone and loaded is None and not cfg.backbone.pretrained:
        say(
            f"[yellow]warning: {results.header['method']} keeps the backbone frozen, and {cfg.backbone.name} has no "
            "pretrained weights (backbone.pretrained=false, no backbone.weights): it learns over random features, so "
            "expect numbers near chance.[/yellow]"
        )
    return loaded
