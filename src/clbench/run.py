"""The one training loop: every method, benchmark and backbone runs through :func:`train`.

For each task: ``before_task`` -> accuracy on the new task before training it (for FWT) -> the method's
phases of epochs -> ``after_task`` -> evaluate every seen task in both scenarios -> write results.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import random
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from hydra.utils import get_class
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from timm.data import Mixup
from torch import nn

from clbench import __version__, checkpoint, distributed
from clbench.backbones import build_backbone, input_stats, sha256, weights_file
from clbench.checkpoint import Cursor, Position
from clbench.comparable import flatten
from clbench.config import RunConfig, TrainerConfig, as_dict, full_config
from clbench.data import Benchmark, DeviceTransform, Split, Task, build_benchmark
from clbench.distributed import Ranks
from clbench.errors import ConfigError, Diverged, Preempted
from clbench.evaluation import SCENARIOS, Evaluation, evaluate
from clbench.files import check_writable, lock_run_folder, remove_stale_temporaries, unlock_run_folder
from clbench.methods import Method
from clbench.methods.base import Phase
from clbench.plateau import Plateau
from clbench.results import Results
from clbench.tracking import WandbTracker, console, print_summary, say, write_run_files


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device


def resolve_device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            "Invalid value for `trainer.device`: 'cuda', but no CUDA device is visible. Allowed: auto, cpu."
        )
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device("cuda", torch.cuda.current_device()) if name == "cuda" else torch.device(name)


def autocast_for(device: torch.device, precision: str) -> AbstractContextManager:
    """bf16 autocast on CUDA by default; fp32 on CPU unless bf16 is asked for."""
    bf16 = precision == "bf16" or (precision == "auto" and device.type == "cuda")
    return torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else nullcontext()


@dataclass
class Runtime:
    """What the loop needs besides the method: data, transforms, device, precision and the process's rank."""

    cfg: RunConfig
    benchmark: Benchmark
    device: torch.device
    train_tf: DeviceTransform
    test_tf: DeviceTransform
    ranks: Ranks

    def mixup(self, task: Task) -> Mixup | None:
        """timm's Mixup/CutMix over the task's classes (DeiT's recipe), or None when both are off."""
        cfg = self.cfg.trainer
        if not (cfg.mixup or cfg.cutmix):
            return None
        return Mixup(
            mixup_alpha=cfg.mixup,
            cutmix_alpha=cfg.cutmix,
            label_smoothing=cfg.label_smoothing,
            num_classes=task.num_classes,
        )

    @property
    def autocast(self) -> AbstractContextManager:
        return autocast_for(self.device, self.cfg.trainer.precision)

    def evaluate(
        self, method: Method, task_ids: list[int], scenarios: tuple[str, ...] = SCENARIOS, split: str = "test"
    ) -> Evaluation:
        return evaluate(
            method,
            self.benchmark,
            task_ids,
            transform=self.test_tf,
            batch_size=self.cfg.trainer.eval_batch_size,
            autocast=self.autocast,
            scenarios=scenarios,
            ranks=self.ranks,
            split=split,
        )


# ------------------------------------------------------------------------------------------ optimisation
def build_optimizer(method: Method, groups: list[dict[str, Any]], cfg: TrainerConfig) -> torch.optim.Optimizer:
    """One optimizer over the method's groups. A group without ``weight_decay`` gets ``trainer.weight_decay``
    except on biases, norms and position/class tokens; the batch-size scaling rule applies to every lr."""
    scale = cfg.batch_size / cfg.lr_scale_batch if cfg.lr_scale_batch else 1.0
    exempt = method.no_weight_decay_ids()
    final: list[dict[str, Any]] = []
    for group in groups:
        params = [p for p in group["params"] if p.requires_grad]
        base = {**group, "lr": group.get("lr", cfg.lr) * scale}
        if "weight_decay" in group:
            final.append({**base, "params": params})
            continue
        decay = [p for p in params if id(p) not in exempt]
        free = [p for p in params if id(p) in exempt]
        final += [
            {**base, "params": decay, "weight_decay": cfg.weight_decay},
            {**base, "params": free, "weight_decay": 0.0},
        ]
    final = [g for g in final if g["params"]]
    if not final:
        raise RuntimeError(f"{type(method).__name__} returned no trainable parameters")
    fused = {"fused": True} if all(p.is_cuda for g in final for p in g["params"]) else {}
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(final, lr=cfg.lr, momentum=cfg.momentum)
    opt_cls = torch.optim.AdamW if cfg.optimizer == "adamw" else torch.optim.Adam
    return opt_cls(final, lr=cfg.lr, **fused)


def lr_factor(step: int, total: int, warmup: int, cfg: TrainerConfig) -> float:
    """Linear warm-up, then cosine decay to ``min_lr`` (or constant); a factor on each group's lr."""
    if step < warmup:
        return (step + 1) / warmup
    if cfg.schedule != "cosine" or total <= warmup:
        return 1.0
    progress = (step - warmup) / (total - warmup)
    floor = cfg.min_lr / cfg.lr
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


# ------------------------------------------------------------------------------------------ one task
class TaskLoss(nn.Module):
    """``method.training_loss`` on one task as a module: the unit DDP wraps to average gradients over ranks."""

    def __init__(self, method: Method, task: Task) -> None:
        super().__init__()
        self.method, self.task = method, task

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return self.method.training_loss(x, y, self.task)


def train_step(
    method: Method,
    task: Task,
    rt: Runtime,
    x_raw: torch.Tensor,
    y: torch.Tensor,
    *,
    optimizer: torch.optim.Optimizer,
    params: list[torch.Tensor],
    model: nn.Module | None = None,
    mixing: Mixup | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One optimisation step on a raw uint8 batch: device augmentation, loss, backward, the method's gradient
    surgery, clipping, the optimizer step, the method's constraints. Returns the detached loss (no host sync).
    ``model``: the DDP-wrapped :class:`TaskLoss` of a multi-process run; this rank trains on its share of the
    batch, its loss weighted so that the averaged gradients are the whole batch's. ``mixing``: the phase's
    :meth:`Runtime.mixup` (built once per phase, not per step)."""
    part, weight = rt.ranks.shard(len(y))
    method.batch_share = (len(y), part)
    if mixing is not None and len(y) % 2 == 0:  # mixed over the whole batch, so each rank's share is one process's rows
        x, y = mixing(rt.train_tf(x_raw), y - task.offset)  # soft targets over the task's classes
        x = x[part]
    else:  # an odd last batch is not mixed (timm's Mixup pairs images)
        x = rt.train_tf(x_raw, part)
    with rt.autocast:
        y = y[part]
        loss, logs = model(x, y) if model is not None else method.training_loss(x, y, task)
    if weight != 1.0:
        loss = loss * weight
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    method.after_backward(task)
    if rt.cfg.trainer.grad_clip:
        torch.nn.utils.clip_grad_norm_(params, rt.cfg.trainer.grad_clip)
    optimizer.step()
    method.after_step(task)
    return loss.detach(), logs


@contextmanager
def stop_signals() -> Iterator[Callable[[], int | None]]:
    """While training, SIGTERM and SIGINT (SLURM preemption, Ctrl-C) only record the signal, which the loop reads
    after each step, so it can write a checkpoint and stop cleanly. SIGUSR2 (submitit's time-limit and preemption
    signal) is caught too where a launcher installed a handler for it; the CLI hands it on after the checkpoint,
    so the launcher requeues the job."""
    if threading.current_thread() is not threading.main_thread():
        yield lambda: None
        return
    raised: list[int] = []
    requeue = [signal.SIGUSR2] if callable(signal.getsignal(signal.SIGUSR2)) else []
    previous = {
        sig: signal.signal(sig, lambda signum, _frame: raised.append(signum)) for sig in (*STOP_SIGNALS, *requeue)
    }
    try:
        yield lambda: raised[0] if raised else None
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def run_task(
    method: Method,
    task: Task,
    rt: Runtime,
    *,
    epochs: int,
    tracker: WandbTracker | None = None,
    progress: Progress | None = None,
    step: int = 0,
    cursor: Cursor | None = None,
    save: Callable[[Cursor, int], None] | None = None,
    stop: Callable[[], int | None] | None = None,
) -> tuple[int, int]:
    """Train ``method`` on ``task`` through its phases; returns (global step, images seen). With ``cursor`` it
    continues a task a checkpoint interrupted (the phase's ``before_phase`` has run then); ``save`` writes a
    checkpoint every ``trainer.checkpoint_every`` epochs and when ``stop`` says a signal arrived."""
    cfg = rt.cfg.trainer
    split = Split.cat([rt.benchmark.train[j] for j in method.train_task_ids(task)])
    per_epoch = split.num_batches(cfg.batch_size)
    images = 0
    start = cursor or Cursor()
    method.train()
    for p, phase in enumerate(method.phases(task, epochs)):
        if p < start.phase:
            continue
        resumed = cursor is not None and p == start.phase
        if not resumed:
            method.before_phase(task, phase)
        if phase.observe:
            images += observe_pass(method, task, split, rt, stop)
            method.train()
            continue
        if phase.epochs == 0:
            continue
        optimizer = build_optimizer(method, method.param_groups(task, phase), cfg)
        params = [q for g in optimizer.param_groups for q in g["params"]]
        model = rt.ranks.wrap(TaskLoss(method, task), rt.device) if rt.ranks.size > 1 else None
        mixing = rt.mixup(task)
        rows = rt.ranks.rows(mirrored=mixing is not None)  # what this rank reads of each streamed batch
        total, warmup = phase.epochs * per_epoch, round(cfg.warmup_epochs * per_epoch)
        plateau = Plateau(cfg.plateau_patience, cfg.plateau_factor) if cfg.schedule == "plateau" else None
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda s, t=total, w=warmup, p=plateau: lr_factor(s, t, w, cfg) * (p.scale if p else 1.0)
        )
        if resumed and start.optimizer is not None and start.schedule is not None:
            optimizer.load_state_dict(start.optimizer)
            schedule.load_state_dict(start.schedule)
        if resumed and plateau is not None and start.plateau is not None:
            plateau = dataclasses.replace(plateau, **start.plateau)
        first_epoch = start.epoch if resumed else 0
        bar = (
            progress.add_task(f"task {task.id} {phase.name}", total=total, completed=first_epoch * per_epoch)
            if progress
            else None
        )
        running = torch.zeros((), device=rt.device)
        for epoch in range(first_epoch, phase.epochs):
            here = resumed and epoch == start.epoch
            order = start.order if here and start.order is not None else split.permutation()
            first_batch, started = start.batch if here else 0, time.time()
            epoch_loss = torch.zeros((), device=rt.device)
            epoch_batches = split.batches(cfg.batch_size, order=order, start=first_batch, rows=rows)
            for batch, (x_raw, y) in enumerate(epoch_batches, first_batch):
                method.before_step(task, batch, per_epoch)
                loss, logs = train_step(
                    method, task, rt, x_raw, y, optimizer=optimizer, params=params, model=model, mixing=mixing
                )
                schedule.step()
                running += loss
                epoch_loss += loss
                step += 1
                images += len(y)
                signum = stop() if stop is not None else None
                if rt.ranks.size > 1:  # ranks decide together, at log steps, so that all stop at the same step
                    signum = rt.ranks.agree(signum) if step % cfg.log_every == 0 else None
                if step % cfg.log_every == 0:  # the only host sync of the step, every log_every steps
                    mean_loss = check_finite(rt, running, cfg.log_every, f"{where(task, phase, epoch)}, step {step}")
                    running.zero_()
                    if tracker:
                        extra = {f"train/{k}": v.item() for k, v in logs.items()}
                        tracker.log({"train/loss": mean_loss, "train/lr": schedule.get_last_lr()[0], **extra}, step)
                    if progress:
                        progress.update(bar, description=f"task {task.id} {phase.name} loss {mean_loss:.3f}")
                if progress:
                    progress.advance(bar)
                if signum is not None and save is not None:
                    state = (optimizer.state_dict(), schedule.state_dict(), plateau.state() if plateau else None)
                    save(Cursor(p, epoch, batch + 1, order, *state), step)
                    name = signal.Signals(signum).name
                    raise Preempted(f"stopped by {name} at task {task.id}, epoch {epoch}, step {step}", signum)
            batches = per_epoch - first_batch  # 0 where a checkpoint was written after the epoch's last batch
            if batches:  # the epoch's mean loss whatever the task length: checked (one host sync) and logged once
                where_ = f"{where(task, phase, epoch)} (its end), step {step}"
                values = {
                    "epoch_loss": check_finite(rt, epoch_loss, batches, where_),
                    "lr": schedule.get_last_lr()[0],
                    "images_per_s": min(batches * cfg.batch_size, len(split)) / max(time.time() - started, 1e-9),
                }
                log_epoch(f"task {task.id} {phase.name} epoch {epoch + 1}/{phase.epochs}", values, rt, tracker, step)
            go_on = True
            if plateau is not None:
                loss = validation_loss(method, task, rt)
                go_on = plateau.update(loss, method, cfg.lr, cfg.min_lr)
                if tracker:
                    tracker.log({"train/validation_loss": loss}, step)
            if save is not None and cfg.checkpoint_every and (epoch + 1) % cfg.checkpoint_every == 0:
                state = (optimizer.state_dict(), schedule.state_dict(), plateau.state() if plateau else None)
                save(Cursor(p, epoch + 1, 0, None, *state), step)
            if not go_on:
                break
        if plateau is not None:
            plateau.restore_best(method)
        if progress:
            progress.remove_task(bar)
    return step, images


def log_epoch(label: str, values: dict[str, float], rt: Runtime, tracker: WandbTracker | None, step: int) -> None:
    """An epoch's line (loss, lr, images/s): to W&B and clbench.log always, and to the terminal where no progress bar
    shows (a SLURM log, a pipe)."""
    if tracker:
        tracker.log({f"train/{k}": v for k, v in values.items()}, step)
    say(
        f"{label}: loss {values['epoch_loss']:.4f}, lr {values['lr']:.3g}, {values['images_per_s']:.0f} images/s",
        terminal=rt.ranks.is_main and not console.is_terminal,
    )


@torch.no_grad()
def observe_pass(
    method: Method, task: Task, split: Split, rt: Runtime, stop: Callable[[], int | None] | None = None
) -> int:
    """An ``observe`` phase: the task's training images once, in order, through the test transform (no augmentation)
    and ``method.observe`` in eval mode, each rank its share of every batch; then the method's sums are added up over
    the ranks. A stop signal ends it without a checkpoint: resuming repeats the pass from the task's start."""
    method.eval()
    for x_raw, y in split.batches(rt.cfg.trainer.batch_size, rows=rt.ranks.rows()):
        part, weight = rt.ranks.shard(len(y))
        if weight:
            with rt.autocast:
                method.observe(rt.test_tf(x_raw, part), y[part], task)
        signum = stop() if stop is not None else None
        if signum is not None:
            raise Preempted(f"stopped by {signal.Signals(signum).name} while observing task {task.id}", signum)
    for total in method.observations():
        rt.ranks.sum_(total)
    return len(split)


@torch.no_grad()
def validation_loss(method: Method, task: Task, rt: Runtime) -> float:
    """Mean cross-entropy of ``task``'s validation images under its own head (TIL), the plateau schedule's signal."""
    split = rt.benchmark.validation[task.id]
    method.eval()
    total = torch.zeros((), device=rt.device)
    for x_raw, y in split.batches(rt.cfg.trainer.eval_batch_size, rows=rt.ranks.rows()):
        part, weight = rt.ranks.shard(len(y))
        if weight:
            with rt.autocast:
                logits = method.predict(rt.test_tf(x_raw, part), task.id)
            total += F.cross_entropy(logits.float(), y[part] - task.offset, reduction="sum")
    method.train()
    return rt.ranks.sum_(total).item() / len(split)


def where(task: Task, phase: Phase, epoch: int) -> str:
    return f"task {task.id} ({phase.name} phase), epoch {epoch}"


def check_finite(rt: Runtime, running: torch.Tensor, steps: int, position: str) -> float:
    """The mean of the last ``steps`` losses (summed over ranks: one host sync); a non-finite one stops the run with
    :class:`Diverged` before the task can be recorded as trained."""
    mean_loss = rt.ranks.sum_(running / (steps * rt.ranks.size)).item()
    if not math.isfinite(mean_loss):
        raise Diverged(
            f"the mean training loss of the last {steps} steps is {mean_loss} at {position}; "
            "lower trainer.lr or set trainer.grad_clip"
        )
    return mean_loss


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


def finish_untrained(method: Method, task: Task, epochs: int = 0) -> None:
    """Take a started task through its phases' transitions and ``after_task`` without a training step
    (PackNet still prunes): the lifecycle of the random-init probe and of a checkpoint's replay."""
    for phase in method.phases(task, epochs):
        method.before_phase(task, phase)
    method.after_task(task)


# ------------------------------------------------------------------------------------------ the run
def build_runtime(cfg: RunConfig) -> tuple[Method, Runtime]:
    """Seed, then build the benchmark (on the device), the backbone, the method and the transforms."""
    device = resolve_device(cfg.trainer.device)
    seed_everything(cfg.seed)
    benchmark = build_benchmark(cfg.data, device, say, distributed.current())
    backbone = build_backbone(cfg.backbone)
    mean, std = input_stats(backbone, cfg.backbone)
    method = get_class(cfg.method_target)(backbone, benchmark, cfg.method).to(device)
    if (cfg.trainer.mixup or cfg.trainer.cutmix) and not method.takes_soft_targets():
        raise ConfigError(
            f"Invalid value for `trainer.mixup`/`trainer.cutmix`: {cfg.trainer.mixup}/{cfg.trainer.cutmix} with "
            f"{type(method).__name__}, whose loss is not cross-entropy over the task's classes. Allowed: 0 (off), or a "
            "method that takes mixed targets: meat, packnet, piggyback, supsup, hat, finetune with loss_scope=task."
        )
    if cfg.trainer.compile:
        compile_blocks(method)
    size = cfg.backbone.img_size
    transforms = (DeviceTransform(cfg.data, size, mean, std, train=t) for t in (True, False))
    return method, Runtime(cfg, benchmark, device, *transforms, ranks=distributed.current())


def compile_blocks(method: Method) -> None:
    """torch.compile each transformer block in place (parameter names unchanged). Blocks are compiled rather
    than the whole model because methods call the backbone's parts (forward_features, blocks) directly. A
    block dynamo cannot compile runs eagerly instead of failing the run."""
    torch._dynamo.config.suppress_errors = True
    for block in method.backbone.blocks:
        block.compile()


def header(cfg: RunConfig) -> dict[str, Any]:
    return {
        "clbench_version": __version__,
        "method": cfg.method_target.rsplit(".", 1)[-1].lower(),
        "backbone": cfg.backbone.name,
        "benchmark": cfg.data.name,
        "seed": cfg.seed,
        "class_order_seed": cfg.data.class_order_seed,
        "method_config": as_dict(cfg.method),
        "backbone_config": as_dict(cfg.backbone),
        "config": full_config(cfg),
    }


def identity(cfg: RunConfig) -> dict[str, Any]:
    """What must not change when a run is resumed: method, data, backbone, seed and the optimisation recipe."""
    keep = ("epochs", "batch_size", "lr", "lr_scale_batch", "optimizer", "momentum", "weight_decay", "schedule")
    keep += ("plateau_patience", "plateau_factor", "mixup", "cutmix", "label_smoothing")
    trainer = as_dict(cfg.trainer)
    return {
        "method": cfg.method_target,
        "method_config": as_dict(cfg.method),
        "data": as_dict(cfg.data),
        "backbone": as_dict(cfg.backbone),
        "seed": cfg.seed,
        "trainer": {k: trainer[k] for k in (*keep, "warmup_epochs", "min_lr", "grad_clip", "precision")},
    }


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


Saved = tuple[Position, dict[str, Any]]  # a loaded checkpoint


def check_identity(cfg: RunConfig, run_dir: Path, state: dict[str, Any]) -> None:
    """Refuse to resume ``run_dir`` with a checkpoint written for another run (naming every key that differs)."""
    saved, now = flatten(state["identity"]), flatten(identity(cfg))
    changed = sorted(k for k in saved.keys() | now.keys() if saved.get(k, "<unset>") != now.get(k, "<unset>"))
    if changed:
        differ = "; ".join(
            f"{k}: checkpoint {saved.get(k, '<unset>')!r}, now {now.get(k, '<unset>')!r}" for k in changed
        )
        raise ConfigError(
            f"Cannot resume {run_dir}: its checkpoint is for another run ({differ}). Resume with the run's own "
            "settings, or start a new run in another folder. The folder is left as it was."
        )


def restore(cfg: RunConfig, saved: Saved, method: Method, rt: Runtime, results: Results) -> tuple[Position, str | None]:
    """Bring ``method`` and ``results`` to the state of a checkpoint (checked with :func:`check_identity`)."""
    position, state = saved
    replay(method, rt.benchmark.tasks, position, cfg.trainer.epochs)
    method.load_state_dict(state["method"])
    results.restore(state["results"])
    checkpoint.restore_rng(state["rng"])
    return position, state["wandb_id"]


def train(
    cfg: RunConfig,
    run_dir: Path,
    *,
    name: str | None = None,
) -> Results:
    """Run the whole experiment described by ``cfg``; results land in ``run_dir`` after every task. With
    ``cfg.resume`` (true, or auto where a checkpoint exists) it continues from ``run_dir``'s checkpoint and ends
    with the same results as an uninterrupted run. In a multi-process run (torchrun) every rank trains and
    evaluates its share; only rank 0 writes the folder, the checkpoints and W&B."""
    main = distributed.current().is_main
    resuming = cfg.resume is True or (cfg.resume == "auto" and (run_dir / checkpoint.FILE).exists())
    # The checkpoint is loaded once, here: a missing, corrupt or foreign one is reported before the folder is touched
    # or anything is built.
    saved = checkpoint.load(run_dir) if resuming else None
    if saved is not None:
        check_identity(cfg, run_dir, saved[1])
    if main:
        check_writable(run_dir)
    acquired = main and lock_run_folder(run_dir)
    try:
        if main:
            remove_stale_temporaries(run_dir)
        return train_in_folder(cfg, run_dir, name, main, saved)
    finally:
        if acquired:
            unlock_run_folder(run_dir)


def train_in_folder(cfg: RunConfig, run_dir: Path, name: str | None, main: bool, saved: Saved | None) -> Results:
    """:func:`train` once the run folder is held; ``saved``: the checkpoint it resumes from."""
    method, rt = build_runtime(cfg)
    benchmark, device = rt.benchmark, rt.device
    results = Results(header(cfg), benchmark.tasks)
    results.header["device"] = str(device)
    loaded = weights_file(cfg.backbone, method.backbone)
    results.header["backbone_config"] |= {
        "weights_file": str(loaded) if loaded else None,
        "weights_sha256": sha256(loaded) if loaded else None,  # two runs on different weights never look alike
    }
    if benchmark.splits:
        results.header["data_splits"] = benchmark.splits
    if main and not method.changes_backbone and loaded is None and not cfg.backbone.pretrained:
        say(
            f"[yellow]warning: {results.header['method']} keeps the backbone frozen, and {cfg.backbone.name} has no "
            "pretrained weights (backbone.pretrained=false, no backbone.weights): it learns over random features, so "
            "expect numbers near chance.[/yellow]"
        )
    position, wandb_id = restore(cfg, saved, method, rt, results) if saved is not None else (Position(0, 0), None)
    logger = cfg.logger if main else dataclasses.replace(cfg.logger, mode="disabled")
    tracker = WandbTracker(logger, run_dir, results.header["config"], name=name, run_id=wandb_id)
    results.header["wandb"] = tracker.identity()

    def save(task_id: int, cursor: Cursor | None, step: int) -> None:
        if not main:
            return
        payload = {
            "identity": identity(cfg),
            "method": method.state_dict(),
            "results": results.state(),
            "wandb_id": tracker.run_id,
        }
        checkpoint.save(run_dir, Position(task_id, step, cursor), payload)

    exit_code = 1
    try:
        if cfg.trainer.eval_random_init and saved is None:
            results.random_init = measure_random_init(method, rt)
        step = position.step
        columns = (
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
        )
        progress_bars = Progress(*columns, console=console, transient=True, disable=not main)
        with progress_bars as progress, stop_signals() as stop:
            for task in benchmark.tasks[position.task :]:
                cursor = position.cursor if task.id == position.task else None
                if cursor is None:
                    method.before_task(task)
                    if task.id > 0:
                        before = rt.evaluate(method, [task.id], ("til",))
                        results.before_task["til"][task.id] = before.accuracy["til"][0]
                        results.before_task["cil"][task.id] = 0.0  # its classes are unseen: no CIL guess can hit
                start = time.perf_counter()
                step, images = run_task(
                    method,
                    task,
                    rt,
                    epochs=cfg.trainer.epochs,
                    tracker=tracker,
                    progress=progress,
                    step=step,
                    cursor=cursor,
                    save=lambda c, s, t=task.id: save(t, c, s),
                    stop=stop,
                )
                method.after_task(task)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                train_s = time.perf_counter() - start
                start = time.perf_counter()
                seen = list(range(task.id + 1))
                validation = rt.evaluate(method, seen, split="validation") if benchmark.validation else None
                results.add_stage(rt.evaluate(method, seen), validation)
                eval_s = time.perf_counter() - start
                results.timing["train_s"].append(round(train_s, 3))
                results.timing["eval_s"].append(round(eval_s, 3))
                results.timing["train_images_per_s"].append(round(images / train_s, 1) if train_s > 0 else None)
                results.storage = method.storage()
                results.extra = method.extra_results()
                if main:
                    artifacts = {k: v.cpu().contiguous() for k, v in method.artifacts().items()}
                    write_run_files(results, run_dir, artifacts=artifacts)
                save(task.id + 1, None, step)
                if not main:
                    continue
                tracker.log_stage(results, run_dir, step)
                row = results.rows
                say(
                    f"task {task.id}: TIL {row['til'][-1][task.id]:.1f}% / CIL {row['cil'][-1][task.id]:.1f}% on it; "
                    f"mean over seen tasks TIL {np.mean(row['til'][-1][: task.id + 1]):.1f}% "
                    f"CIL {np.mean(row['cil'][-1][: task.id + 1]):.1f}%  ({train_s:.1f}s train, {eval_s:.1f}s eval)"
                )
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
        if main:
            write_run_files(results, run_dir, heatmaps=results.stages > 0)
        tracker.finish(results, run_dir, exit_code)
    if main:
        print_summary(results, run_dir)
    return results
