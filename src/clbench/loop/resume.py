"""Resuming a run from its checkpoint: what must match (:func:`identity`), and how a fresh method is brought to the
checkpoint's state (:func:`replay` the lifecycle without training, then load every tensor)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from clbench import checkpoint
from clbench.checkpoint import Position
from clbench.comparable import LATER_KEYS, flatten, is_setting
from clbench.config import RunConfig, as_dict
from clbench.data import Task
from clbench.errors import ConfigError, DataError
from clbench.methods import Method
from clbench.results import Results

Saved = tuple[Position, dict[str, Any]]  # a loaded checkpoint


def identity(cfg: RunConfig) -> dict[str, Any]:
    """What must not change when a run is resumed: method, data, backbone, seed and the optimisation recipe."""
    keep = ("epochs", "batch_size", "lr", "lr_scale_batch", "optimizer", "momentum", "weight_decay", "schedule")
    keep += ("lr_decay", "milestones", "schedule_steps", "cosine_epochs")
    keep += ("plateau_patience", "plateau_factor", "mixup", "cutmix", "label_smoothing", "drop_last")
    trainer = as_dict(cfg.trainer)
    return {
        "method": cfg.method_target,
        "method_config": as_dict(cfg.method),
        "data": as_dict(cfg.data),
        "backbone": as_dict(cfg.backbone),
        "memory": as_dict(cfg.memory),
        "seed": cfg.seed,
        "trainer": {k: trainer[k] for k in (*keep, "warmup_epochs", "min_lr", "grad_clip", "precision")},
    }


def check_identity(cfg: RunConfig, run_dir: Path, state: dict[str, Any]) -> list[str]:
    """Refuse to resume ``run_dir`` with a checkpoint written for another run (naming every key that differs). Keys
    that cannot change the results (where the data lives and how it is read: :data:`clbench.comparable.NOT_A_SETTING`
    but the seed; ``data.val_seed`` without a validation split) may differ: returns them, ``key: before -> now``."""
    now = flatten(identity(cfg))
    # an older checkpoint: the old values of the keys added since, where this run has them (a method's own keys;
    # the identity holds method.<key> as method_config.<key>)
    later = {re.sub(r"^method\.", "method_config.", k): v for k, v in LATER_KEYS.items()}
    saved = {k: v for k, v in later.items() if k in now} | flatten(state["identity"])
    changed = sorted(k for k in saved.keys() | now.keys() if saved.get(k, "<unset>") != now.get(k, "<unset>"))
    no_validation = not saved.get("data.val_fraction") and not now.get("data.val_fraction")
    # The seed sets two runs of one setting apart, so it is not a setting; a resumed run must keep it all the same.
    harmless = [k for k in changed if k != "seed" and (not is_setting(k) or (k == "data.val_seed" and no_validation))]
    refused = [k for k in changed if k not in harmless]
    if refused:
        differ = "; ".join(
            f"{k}: checkpoint {saved.get(k, '<unset>')!r}, now {now.get(k, '<unset>')!r}" for k in refused
        )
        raise ConfigError(
            f"Cannot resume {run_dir}: its checkpoint is for another run ({differ}). Resume with the run's own "
            "settings, or start a new run in another folder. The folder is left as it was."
        )
    return [f"{k}: {saved.get(k, '<unset>')!r} -> {now.get(k, '<unset>')!r}" for k in harmless]


def finish_untrained(method: Method, task: Task, epochs: int = 0) -> None:
    """Take a started task through its phases' transitions and ``after_task`` without a training step
    (PackNet still prunes): the lifecycle of the random-init probe and of a checkpoint's replay."""
    for phase in method.phases(task, epochs):
        method.before_phase(task, phase)
    method.after_task(task)


def replay(method: Method, tasks: list[Task], position: Position, epochs: int) -> None:
    """Give a fresh method the structure it had at ``position`` (heads, per-task masks and buffers, state
    machines) by walking the lifecycle without training; a checkpoint's tensors then replace every value."""
    for task in tasks[: position.task]:
        method.before_task(task)
        finish_untrained(method, task, epochs)
    if position.cursor is not None:
        task = tasks[position.task]
        method.before_task(task)
        for phase in method.phases(task, epochs)[: position.cursor.phase + 1]:
            method.before_phase(task, phase)


def restore(
    cfg: RunConfig, saved: Saved, method: Method, tasks: list[Task], results: Results, *, path: Path
) -> tuple[Position, str | None]:
    """Bring ``method`` and ``results`` to the state of the checkpoint ``path`` (checked with :func:`check_identity`);
    returns the position to go on from and the W&B run id. Values that do not fit the run the config builds (shapes,
    missing or extra tensors, a memory's labels and counts, the results' stages) are a :class:`DataError`."""
    position, state = saved
    replay(method, tasks, position, cfg.trainer.epochs)
    try:
        method.load_state_dict(state["method"])
    except RuntimeError as err:
        wrong = "; ".join(line.strip() for line in str(err).splitlines()[1:] if line.strip())[:1500]
        raise DataError(f"Cannot resume: {path} does not fit the run its config builds: {wrong}.") from None
    problems = method.memory.problems(tasks) if method.memory is not None else []
    stages = len(state["results"]["rows"]["til"])
    if stages != position.task:
        problems.append(f"its results hold {stages} trained tasks where its position is at task {position.task}")
    if problems:
        raise DataError(f"Cannot resume: {path} holds what no run writes: {'; '.join(problems)}.")
    results.restore(state["results"])
    checkpoint.restore_rng(state["rng"])
    return position, state["wandb_id"]
