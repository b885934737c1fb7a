"""One task: the method's phases, each a run of epochs over the task's training batches.

:func:`run_task` walks ``method.phases(task)``: an ``observe`` phase is one pass without gradients
(:func:`observe_pass`); a training phase (:class:`PhaseRun`) builds its optimizer and schedule, then for each epoch
draws an order and hands every batch to the phase's :class:`~clbench.loop.step.Stepper`. The loss stays on the device;
every ``trainer.log_every`` steps and at each epoch's end it is read once (one host sync) and checked to be finite.
Checkpoints are written every ``trainer.checkpoint_every`` epochs and when a stop signal arrives.
"""

from __future__ import annotations

import dataclasses
import math
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import closing
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from rich.progress import Progress

from clbench import smoke
from clbench.checkpoint import Cursor
from clbench.config import TrainerConfig
from clbench.data import Split, Task
from clbench.distributed import Ranks
from clbench.errors import ConfigError, Diverged, Preempted
from clbench.loop.divergence import FirstNonFinite
from clbench.loop.optim import build_optimizer, current_lr, load_optimizer_state, lr_factor, rates_on_device
from clbench.loop.runtime import Runtime
from clbench.loop.step import Stepper
from clbench.loop.trained_parts import parameter_parts, trained_counts
from clbench.methods import Method
from clbench.methods.base import Logs, Phase
from clbench.plateau import Plateau
from clbench.tracking import WandbTracker, console, say


@dataclass
class Hooks:
    """What the run hands a task: where it logs (``tracker``, ``progress``), how it checkpoints (``save`` of a cursor
    at a global step) and how it learns of a stop signal (``stop``: the signal number once one arrived)."""

    tracker: WandbTracker | None = None
    progress: Progress | None = None
    save: Callable[[Cursor, int], None] | None = None
    stop: Callable[[], int | None] | None = None
    trains: Callable[[Task, Phase, dict[str, int]], None] | None = None  # what a phase trains, by part
    # a training phase's diagnostics: the mean over its steps of each value the method's loss logs
    diagnostics: Callable[[Task, Phase, int, dict[str, float]], None] | None = None

    def signal(self) -> int | None:
        return self.stop() if self.stop is not None else None


def run_task(
    method: Method,
    task: Task,
    rt: Runtime,
    *,
    epochs: int,
    step: int = 0,
    cursor: Cursor | None = None,
    hooks: Hooks | None = None,
) -> tuple[int, int]:
    """Train ``method`` on ``task`` through its phases; returns (global step, images seen). With ``cursor`` it
    continues a task a checkpoint interrupted (the phase's ``before_phase`` has run then)."""
    hooks = hooks or Hooks()
    split = Split.cat([rt.benchmark.train[j] for j in method.train_task_ids(task)])
    start, images = cursor or Cursor(), 0
    method.train()
    for p, phase in enumerate(method.phases(task, epochs)):
        if p < start.phase:
            continue
        resumed = cursor is not None and p == start.phase
        if not resumed:
            method.before_phase(task, phase)
        if phase.memory:
            update_memory(method, task, rt)
            method.train()
        elif phase.observe:
            data = phase_data(method, phase, split, rt.streamed_from)
            images += observe_pass(method, task, data, rt, hooks.stop, augment=phase.augment)
            method.train()
        elif phase.epochs:
            data = None if phase.data == "features" else phase_data(method, phase, split, rt.streamed_from)
            run = PhaseRun(method, task, phase, p, split=data, rt=rt, hooks=hooks, resume=start if resumed else None)
            step, seen = run.epochs(step)
            images += seen
    return step, images


def phase_trainer(cfg: TrainerConfig, phase: Phase) -> TrainerConfig:
    """The run's trainer settings with the phase's own (:attr:`Phase.trainer`) in their place, checked as the run's
    are."""
    return dataclasses.replace(cfg, **phase.trainer) if phase.trainer else cfg


def phase_data(method: Method, phase: Phase, split: Split, streamed_from: list[Split] | None = None) -> Split:
    """What a training phase trains on (:attr:`Phase.data`): the task's ``split`` (less the images the memory holds
    out for validation), the memory's training images, both, or the validation images: the memory's and those held
    out of the task that it has not stored yet (BiC's bias stage, before the memory update). ``streamed_from``: the
    benchmark's training splits where they are streamed from disk; the memory's images are then read from where they
    came from, to be streamed with the task's."""
    memory = method.memory
    held_out = memory.held_out if memory is not None else []
    if held_out and phase.data in ("task", "task+memory"):
        kept = torch.ones(len(split), dtype=torch.bool)
        kept[held_out] = False
        split = subset(split, kept.nonzero().flatten())
    if phase.data == "task":
        return split
    if memory is None or memory.empty:
        raise RuntimeError(f"the {phase.name} phase trains on the memory, which holds nothing")
    if phase.data == "task+memory":
        return Split.cat([split, memory.held_split(streamed_from=streamed_from)])
    if phase.data == "validation":
        own = subset(split, torch.tensor(memory.pending, dtype=torch.long))
        return Split.cat([memory.held_split(validation=True, streamed_from=streamed_from), own])
    return memory.held_split()


def subset(split: Split, rows: torch.Tensor) -> Split:
    """The ``rows`` of ``split`` (a host index), as a split."""
    index = rows.to(split.y.device)
    return Split(split.x[index], split.y[index])


@torch.no_grad()
def update_memory(method: Method, task: Task, rt: Runtime) -> None:
    """A ``memory`` phase: the memory's sampler chooses from the task's training images (herding on their features,
    and with ``memory.reselect`` on the held images' too: eval mode, no augmentation); rank 0's choice is every
    rank's."""
    memory, split = method.memory, rt.benchmark.train[task.id]
    assert memory is not None
    labels = split.y.cpu()
    features = held = None
    if memory.sampler == "herding":
        method.eval()
        features = batched_features(method, task, rt, (x for x, _ in split.batches(rt.cfg.trainer.eval_batch_size)))
        if memory.reselect and not memory.empty:
            size = rt.cfg.trainer.eval_batch_size
            images = memory.images[: memory.capacity]
            held = batched_features(method, task, rt, (images[i : i + size] for i in range(0, len(images), size)))
    plan = rt.ranks.broadcast(memory.plan(task, labels, features, held))
    rows = torch.tensor(plan.rows(), dtype=torch.long, device=split.y.device)
    images = split.batch(rows, 0, len(rows))[0] if len(rows) else split.x[:0]
    first = sum(len(s) for s in rt.benchmark.train[: task.id])  # where the task's images start in the training data
    memory.write(plan, images, labels[rows.cpu()], task.id, first=first)


def batched_features(method: Method, task: Task, rt: Runtime, batches: Iterator[torch.Tensor]) -> torch.Tensor:
    """The method's features (fp32, on the device) of raw image batches through the test transform."""
    chunks = []
    for x_raw in batches:
        with rt.autocast:
            chunks.append(method.features(rt.test_tf(x_raw), task.id).float())
    return torch.cat(chunks)


class PhaseRun:
    """A training phase: its optimizer, learning-rate schedule (and plateau state), stepper and epochs; ``resume``:
    the cursor of a checkpoint written inside this phase. A ``features`` phase (``split`` None) trains on what
    ``method.drawn_split`` draws for each epoch: no image is read or augmented, and none is counted as trained."""

    def __init__(
        self,
        method: Method,
        task: Task,
        phase: Phase,
        index: int,
        *,
        split: Split | None,
        rt: Runtime,
        hooks: Hooks,
        resume: Cursor | None = None,
    ) -> None:
        self.cfg = cfg = phase_trainer(rt.cfg.trainer, phase)
        self.method, self.task, self.phase, self.index = method, task, phase, index
        self.rt, self.hooks, self.resume = rt, hooks, resume
        self.drawn = phase.data == "features"
        self.drawn_for = resume.epoch if resume is not None else 0  # the epoch whose features self.split holds
        if self.drawn:
            split = method.drawn_split(task, phase, self.drawn_for)
        assert split is not None  # a phase of images is handed its data
        self.split = split
        self.per_epoch = self.split.num_batches(cfg.batch_size, drop_last=cfg.drop_last)
        if not self.per_epoch:
            raise ConfigError(
                f"Invalid value for `trainer.drop_last`: true. Allowed: false here: task {task.id}'s "
                f"{phase.name} phase has {len(self.split)} training samples, fewer than trainer.batch_size="
                f"{cfg.batch_size}, so dropping the last partial batch would train on nothing."
            )
        self.optimizer = build_optimizer(method, task, phase, cfg, capturable=rt.accel.graphs)
        method.check_steps(task, phase, self.optimizer)
        if hooks.trains is not None:
            hooks.trains(task, phase, trained_counts(self.optimizer, parameter_parts(method, rt.backbone_parts)))
        total, warmup = phase.epochs * self.per_epoch, round(cfg.warmup_epochs * self.per_epoch)
        self.plateau = Plateau(cfg.plateau_patience, cfg.plateau_factor) if cfg.schedule == "plateau" else None
        self.schedule = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_factor(s, total, warmup, cfg, self.per_epoch) * self.scale()
        )
        if resume is not None and resume.optimizer is not None and resume.schedule is not None:
            load_optimizer_state(self.optimizer, resume.optimizer)
            self.schedule.load_state_dict(resume.schedule)
        if resume is not None and self.plateau is not None and resume.plateau is not None:
            self.plateau = dataclasses.replace(self.plateau, **resume.plateau)
        rates_on_device(self.optimizer, rt.device)
        mixing = None if self.drawn else rt.mixup(task)
        self.rows = rt.ranks.rows(mirrored=mixing is not None)  # what this rank reads of each streamed batch
        self.stepper = Stepper(method, task, rt, self.optimizer, mixing, trainer=cfg, features=self.drawn)
        self.ids = method.takes_ids()  # hand each batch's positions in the phase's data to the loss
        self.running = torch.zeros((), device=rt.device)  # the losses since the last log step
        self.diagnostics = Diagnostics(rt.device, resume.diagnostics if resume is not None else None)
        self.max_steps = smoke.STEPS_PER_PHASE if rt.cfg.smoke else None  # smoke=true: a step or so a phase

    def scale(self) -> float:
        """The plateau schedule's factor on the learning rate (1 without it)."""
        return self.plateau.scale if self.plateau is not None else 1.0

    def epochs(self, step: int) -> tuple[int, int]:
        """Every epoch of the phase from where it stands; returns (global step, images seen)."""
        first = self.resume.epoch if self.resume is not None else 0
        progress = self.hooks.progress
        bar = (
            progress.add_task(
                f"task {self.task.id} {self.phase.name}",
                total=self.phase.epochs * self.per_epoch,
                completed=first * self.per_epoch,
            )
            if progress
            else None
        )
        images = 0
        try:
            for epoch in range(first, self.phase.epochs):
                here = self.resume is not None and epoch == self.resume.epoch
                step, seen = self.epoch(epoch, step, self.resume if here else None, bar)
                images += seen
                if not self.after_epoch(epoch, step) or self.steps_done():
                    break
            if self.plateau is not None:
                self.plateau.restore_best(self.method)
            if self.hooks.diagnostics is not None and self.diagnostics.sums:
                means = self.diagnostics.means(self.rt.ranks)
                self.hooks.diagnostics(self.task, self.phase, self.diagnostics.steps, means)
        finally:
            self.close()
        if progress and bar is not None:
            progress.remove_task(bar)
        return step, images

    def close(self) -> None:
        """Let go of what the phase held on the device before evaluation and the next phase: its captured graph (and the
        memory pool behind it), the optimizer's state and the gradients."""
        self.stepper.close()
        self.optimizer.state.clear()
        self.method.zero_grad(set_to_none=True)
        if self.rt.device.type == "cuda":
            torch.cuda.empty_cache()

    def epoch(self, epoch: int, step: int, resume: Cursor | None, bar: int | None) -> tuple[int, int]:
        """The epoch's batches (from a checkpoint's batch and order when ``resume`` is set); returns (global step,
        images seen)."""
        cfg, rt, task, hooks = self.cfg, self.rt, self.task, self.hooks
        if self.drawn and epoch != self.drawn_for:
            self.split, self.drawn_for = self.method.drawn_split(task, self.phase, epoch), epoch
        self.method.before_epoch(task, len(self.split), cfg.batch_size)
        order = resume.order if resume is not None and resume.order is not None else self.split.permutation()
        first_batch, started = resume.batch if resume is not None else 0, time.time()
        epoch_loss = torch.zeros((), device=rt.device)
        images = taken = 0  # images trained on (drawn features count none) and steps taken in this epoch
        batches = self.split.batches(
            cfg.batch_size, order=order, start=first_batch, rows=self.rows, drop_last=cfg.drop_last
        )
        with closing(batches):  # a stop or an error mid-epoch shuts a streamed epoch's reader workers down at once
            for batch, (x_raw, y) in enumerate(batches, first_batch):
                self.method.before_step(task, batch, self.per_epoch)
                ids = order[batch * cfg.batch_size : (batch + 1) * cfg.batch_size] if self.ids else None
                loss, logs = self.stepper(x_raw, y, ids)
                self.diagnostics.add(logs)
                self.schedule.step()
                self.running += loss
                epoch_loss += loss
                step += 1
                taken += 1
                images += 0 if self.drawn else len(y)
                signum = hooks.signal()
                if rt.ranks.size > 1:  # ranks decide together, at log steps, so that all stop at the same step
                    signum = rt.ranks.agree(signum) if step % cfg.log_every == 0 else None
                if step % cfg.log_every == 0:  # the only host sync of the step, every log_every steps
                    self.log_steps(logs, epoch, step, bar)
                if hooks.progress and bar is not None:
                    hooks.progress.advance(bar)
                if signum is not None and hooks.save is not None:
                    hooks.save(self.cursor(epoch, batch + 1, order), step)
                    name = signal.Signals(signum).name
                    raise Preempted(f"stopped by {name} at task {task.id}, epoch {epoch}, step {step}", signum)
                if self.steps_done():
                    break
        done = taken  # 0 where a checkpoint was written after the epoch's last batch
        if done:  # the epoch's mean loss whatever the task length: checked (one host sync) and logged once
            position = f"{where(task, self.phase, epoch)} (its end), step {step}"
            rate = min(done * cfg.batch_size, len(self.split)) / max(time.time() - started, 1e-9)
            values = {
                "epoch_loss": check_finite(rt, epoch_loss, done, position, self.stepper.watch),
                "lr": current_lr(self.schedule),
                "features_per_s" if self.drawn else "images_per_s": rate,
            }
            log_epoch(
                f"task {task.id} {self.phase.name} epoch {epoch + 1}/{self.phase.epochs}", values, rt, hooks, step
            )
        return step, images

    def steps_done(self) -> bool:
        """Whether a smoke run's phase has taken its steps (never, in a real run)."""
        return self.max_steps is not None and self.diagnostics.steps >= self.max_steps

    def log_steps(self, logs: Logs, epoch: int, step: int, bar: int | None) -> None:
        """The mean loss of the last ``log_every`` steps (checked finite) and the method's values: W&B, the bar."""
        every = self.cfg.log_every
        position = f"{where(self.task, self.phase, epoch)}, step {step}"
        mean_loss = check_finite(self.rt, self.running, every, position, self.stepper.watch)
        self.running.zero_()
        if self.hooks.tracker:
            extra = {f"train/{k}": v.item() for k, v in logs.items()}
            self.hooks.tracker.log({"train/loss": mean_loss, "train/lr": current_lr(self.schedule), **extra}, step)
        if self.hooks.progress and bar is not None:
            self.hooks.progress.update(bar, description=f"task {self.task.id} {self.phase.name} loss {mean_loss:.3f}")

    def after_epoch(self, epoch: int, step: int) -> bool:
        """The plateau schedule's validation and the periodic checkpoint; False once the plateau ends the phase."""
        cfg, go_on = self.cfg, True
        if self.plateau is not None:
            loss = validation_loss(self.method, self.task, self.rt)
            go_on = self.plateau.update(loss, self.method, cfg.lr, cfg.min_lr)
            if self.hooks.tracker:
                self.hooks.tracker.log({"train/validation_loss": loss}, step)
        if self.hooks.save is not None and cfg.checkpoint_every and (epoch + 1) % cfg.checkpoint_every == 0:
            self.hooks.save(self.cursor(epoch + 1, 0, None), step)
        return go_on

    def cursor(self, epoch: int, batch: int, order: torch.Tensor | None) -> Cursor:
        plateau = self.plateau.state() if self.plateau else None
        optimizer, schedule = self.optimizer.state_dict(), self.schedule.state_dict()
        return Cursor(self.index, epoch, batch, order, optimizer, schedule, plateau, self.diagnostics.state())


class Diagnostics:
    """The values a method's loss logs (MEAT's token keep ratio, EWC's penalty, LwF's distillation, ...), summed on
    the device over a phase's steps (no host sync) and read once, as means, when the phase ends: results.json's
    ``method_diagnostics`` and the run's summary. A checkpoint inside the phase keeps the sums."""

    def __init__(self, device: torch.device, saved: dict[str, Any] | None = None) -> None:
        self.device = device
        self.steps = int(saved["steps"]) if saved else 0
        self.sums = {k: v.to(device) for k, v in saved["sums"].items()} if saved else {}

    def add(self, logs: Logs) -> None:
        self.steps += 1
        for key, value in logs.items():
            total = self.sums.get(key)
            if total is None:
                total = self.sums[key] = torch.zeros((), dtype=torch.float32, device=self.device)
            total.add_(value.detach().float().sum())

    def means(self, ranks: Ranks) -> dict[str, float]:
        """Each value's mean over the phase's steps (and over the ranks, each logging its share)."""
        return {k: ranks.sum_(v / (self.steps * ranks.size)).item() for k, v in self.sums.items()}

    def state(self) -> dict[str, Any]:
        return {"steps": self.steps, "sums": {k: v.detach().cpu().clone() for k, v in self.sums.items()}}


def log_epoch(label: str, values: dict[str, float], rt: Runtime, hooks: Hooks, step: int) -> None:
    """An epoch's line (loss, lr, images/s): to W&B and clbench.log always, and to the terminal where no progress bar
    shows (a SLURM log, a pipe)."""
    if hooks.tracker:
        hooks.tracker.log({f"train/{k}": v for k, v in values.items()}, step)
    unit = "features" if "features_per_s" in values else "images"
    say(
        f"{label}: loss {values['epoch_loss']:.4f}, lr {values['lr']:.3g}, {throughput(values[f'{unit}_per_s'], unit)}",
        terminal=rt.ranks.is_main and not console.is_terminal,
    )


def throughput(per_s: float, unit: str = "images") -> str:
    """``512 images/s``; below one a second, the seconds one takes (``3.2 s/image``: a ViT-B on a CPU). ``unit``:
    what is counted, plural (``features`` in a phase of drawn features)."""
    one = unit.removesuffix("s")
    if per_s >= 1:
        return f"{per_s:.0f} {one if round(per_s) == 1 else unit}/s"
    return f"{1 / per_s:.3g} s/{one}" if per_s > 0 else f"no {unit}"


@torch.no_grad()
def observe_pass(
    method: Method,
    task: Task,
    split: Split,
    rt: Runtime,
    stop: Callable[[], int | None] | None = None,
    *,
    augment: bool = False,
) -> int:
    """An ``observe`` phase: the task's training images once, in order, through the test transform (``augment``: the
    training transform, its random draws made for the whole batch as in training) and ``method.observe`` in eval
    mode, each rank its share of every batch; then the method's sums are added up over the ranks. A stop signal ends
    it without a checkpoint: resuming repeats the pass from the task's start."""
    method.eval()
    size = rt.cfg.trainer.batch_size
    transform = rt.train_tf if augment else rt.test_tf
    for index, (x_raw, y) in enumerate(split.batches(size, rows=rt.ranks.rows())):
        part, weight = rt.ranks.shard(len(y))
        method.batch_share = (len(y), part)  # per-sample draws (EWC's sampled labels) made for the whole batch
        x = transform(x_raw, part)  # on every rank: augmentation draws keep the ranks' random streams in lockstep
        if weight:
            rows = torch.arange(index * size, index * size + len(y), device=y.device)[part]
            with rt.autocast:
                method.observe(x, y[part], task, rows)
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


def check_finite(rt: Runtime, running: torch.Tensor, steps: int, position: str, watch: FirstNonFinite) -> float:
    """The mean of the last ``steps`` losses (summed over ranks: one host sync); a non-finite one stops the run with
    :class:`Diverged` before the task can be recorded as trained, naming what ``watch`` saw go non-finite first."""
    mean_loss = rt.ranks.sum_(running / (steps * rt.ranks.size)).item()
    if not math.isfinite(mean_loss):
        raise Diverged(
            f"the mean training loss of the last {steps} steps is {mean_loss} at {position}; {watch.describe()}"
        )
    return mean_loss
