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
from collections.abc import Callable
from contextlib import closing
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from rich.progress import Progress

from clbench.checkpoint import Cursor
from clbench.config import TrainerConfig
from clbench.data import Split, Task
from clbench.errors import Diverged, Preempted
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
            images += observe_pass(method, task, phase_data(method, phase, split, rt.streamed_from), rt, hooks.stop)
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
    out for validation), the memory's training images, both, or the memory's validation images. ``streamed_from``:
    the benchmark's training splits where they are streamed from disk; both are then streamed together, the memory's
    images read from where they came from."""
    memory = method.memory
    if memory is not None and memory.held_out and phase.data in ("task", "task+memory"):
        kept = torch.ones(len(split), dtype=torch.bool)
        kept[memory.held_out] = False
        index = kept.nonzero().flatten().to(split.y.device)
        split = Split(split.x[index], split.y[index])
    if phase.data == "task":
        return split
    if memory is None or memory.empty:
        raise RuntimeError(f"the {phase.name} phase trains on the memory, which holds nothing")
    if phase.data == "task+memory":
        return Split.cat([split, memory.held_split(streamed_from=streamed_from)])
    return memory.held_split(validation=phase.data == "validation")


@torch.no_grad()
def update_memory(method: Method, task: Task, rt: Runtime) -> None:
    """A ``memory`` phase: the memory's sampler chooses from the task's training images (herding on their features,
    in eval mode, without augmentation); rank 0's choice is every rank's."""
    memory, split = method.memory, rt.benchmark.train[task.id]
    assert memory is not None
    labels = split.y.cpu()
    features = None
    if memory.sampler == "herding":
        method.eval()
        chunks = []
        for x_raw, _ in split.batches(rt.cfg.trainer.eval_batch_size):
            with rt.autocast:
                chunks.append(method.features(rt.test_tf(x_raw), task.id).float())
        features = torch.cat(chunks)
    plan = rt.ranks.broadcast(memory.plan(task, labels, features))
    rows = torch.tensor(plan.rows(), dtype=torch.long, device=split.y.device)
    images = split.batch(rows, 0, len(rows))[0] if len(rows) else split.x[:0]
    first = sum(len(s) for s in rt.benchmark.train[: task.id])  # where the task's images start in the training data
    memory.write(plan, images, labels[rows.cpu()], task.id, first=first)


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
        self.per_epoch = self.split.num_batches(cfg.batch_size)
        self.optimizer = build_optimizer(method, task, phase, cfg, capturable=rt.accel.graphs)
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
                if not self.after_epoch(epoch, step):
                    break
            if self.plateau is not None:
                self.plateau.restore_best(self.method)
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
        images = 0
        batches = self.split.batches(cfg.batch_size, order=order, start=first_batch, rows=self.rows)
        with closing(batches):  # a stop or an error mid-epoch shuts a streamed epoch's reader workers down at once
            for batch, (x_raw, y) in enumerate(batches, first_batch):
                self.method.before_step(task, batch, self.per_epoch)
                ids = order[batch * cfg.batch_size : (batch + 1) * cfg.batch_size] if self.ids else None
                loss, logs = self.stepper(x_raw, y, ids)
                self.schedule.step()
                self.running += loss
                epoch_loss += loss
                step += 1
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
        done = self.per_epoch - first_batch  # 0 where a checkpoint was written after the epoch's last batch
        if done:  # the epoch's mean loss whatever the task length: checked (one host sync) and logged once
            position = f"{where(task, self.phase, epoch)} (its end), step {step}"
            rate = min(done * cfg.batch_size, len(self.split)) / max(time.time() - started, 1e-9)
            values = {
                "epoch_loss": check_finite(rt, epoch_loss, done, position),
                "lr": current_lr(self.schedule),
                "features_per_s" if self.drawn else "images_per_s": rate,
            }
            log_epoch(
                f"task {task.id} {self.phase.name} epoch {epoch + 1}/{self.phase.epochs}", values, rt, hooks, step
            )
        return step, images

    def log_steps(self, logs: Logs, epoch: int, step: int, bar: int | None) -> None:
        """The mean loss of the last ``log_every`` steps (checked finite) and the method's values: W&B, the bar."""
        every = self.cfg.log_every
        mean_loss = check_finite(self.rt, self.running, every, f"{where(self.task, self.phase, epoch)}, step {step}")
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
        return Cursor(self.index, epoch, batch, order, self.optimizer.state_dict(), self.schedule.state_dict(), plateau)


def log_epoch(label: str, values: dict[str, float], rt: Runtime, hooks: Hooks, step: int) -> None:
    """An epoch's line (loss, lr, images/s): to W&B and clbench.log always, and to the terminal where no progress bar
    shows (a SLURM log, a pipe)."""
    if hooks.tracker:
        hooks.tracker.log({f"train/{k}": v for k, v in values.items()}, step)
    unit = "features" if "features_per_s" in values else "images"
    say(
        f"{label}: loss {values['epoch_loss']:.4f}, lr {values['lr']:.3g}, {values[f'{unit}_per_s']:.0f} {unit}/s",
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
    size = rt.cfg.trainer.batch_size
    for index, (x_raw, y) in enumerate(split.batches(size, rows=rt.ranks.rows())):
        part, weight = rt.ranks.shard(len(y))
        method.batch_share = (len(y), part)  # per-sample draws (EWC's sampled labels) made for the whole batch
        if weight:
            rows = torch.arange(index * size, index * size + len(y), device=y.device)[part]
            with rt.autocast:
                method.observe(rt.test_tf(x_raw, part), y[part], task, rows)
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
