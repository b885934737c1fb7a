"""One training step, and the ways it runs: eagerly, compiled, or replayed as one CUDA graph.

A step (:func:`train_step`): device augmentation -> the method's loss under autocast -> backward -> the method's
gradient surgery (``after_backward``) -> clipping -> the optimizer step -> the method's constraints (``after_step``).

:class:`Stepper` runs the steps of one phase:

- ``trainer.compile`` (auto: on CUDA): the method's forward and loss (``method.training_loss``: the backbone with the
  method's masks, gates or prompts, and its loss terms) go through ``torch.compile``, its backward through the
  compiled autograd graph. Full batches use the compiled loss; a batch of another size (an epoch's last) runs eagerly,
  so no second graph is compiled for it. Dynamo's caches are reset at every phase (each task's heads and masks make a
  new graph). A compile failure warns once and the run trains eagerly from then on.
- ``trainer.cuda_graphs`` (auto: on CUDA where the step is static): the phase's first :data:`WARMUP_STEPS` full
  batches run eagerly on a side stream (optimizer state, compilation, lazy initialisation), the next is captured as
  one CUDA graph, and every full batch after it copies its images and labels into the captured input buffers and
  replays the graph: every kernel of the step, the random augmentation and MEAT's Gumbel noise included (each replay
  draws new numbers from the device generator). What changes from step to step outside the graph lives in device
  tensors written before each replay: the learning rates (:func:`clbench.loop.optim.rates_on_device`) and HAT's
  annealed s (``before_step``). A batch of another size runs eagerly on the same parameters, optimizer state and
  learning-rate tensors (its gradients are dropped after it: the graph writes its own). A capture that fails is an
  error that names ``trainer.cuda_graphs=false``: a failed capture leaves CUDA's allocator and streams in states a
  run must not go on in.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
from timm.data import Mixup
from torch import nn
from torch._dynamo.utils import counters

from clbench.config import STEP_SAMPLERS, TrainerConfig
from clbench.data import Task
from clbench.errors import GraphCaptureError
from clbench.loop.divergence import FirstNonFinite
from clbench.loop.runtime import Runtime, replay_rows
from clbench.memory import STORED_FIRST
from clbench.methods import Method
from clbench.methods.base import Logs, Replay
from clbench.tracking import say

WARMUP_STEPS = 2  # eager steps of a phase before its capture: optimizer state, compilation and autotuning happen here
StepOut = tuple[torch.Tensor, Logs]


class TaskLoss(nn.Module):
    """``method.training_loss`` on one task as a module: the unit DDP wraps to average gradients over ranks. A batch
    of ``full`` rows goes through ``compiled`` (the compiled ``training_loss``) where there is one; if it fails (out
    of memory aside), ``failed`` is told and the batch goes through the eager loss (tracing draws no random number, so
    the step is the eager one); an error of the eager loss itself is raised from there."""

    def __init__(
        self,
        method: Method,
        task: Task,
        compiled: Callable[..., StepOut] | None = None,
        full: int = 0,
        failed: Callable[[Exception], None] | None = None,
    ) -> None:
        super().__init__()
        self.method, self.task, self.compiled, self.full, self.failed = method, task, compiled, full, failed

    def forward(self, x: torch.Tensor, y: torch.Tensor, **extra: Any) -> StepOut:
        if self.compiled is not None and len(x) == self.full:
            try:
                return self.compiled(x, y, self.task, **extra)
            except torch.OutOfMemoryError:
                raise
            except Exception as err:  # dynamo's errors, and torch's own asserts inside a compiled graph
                if self.failed is None:
                    raise
                self.failed(err)
        return self.method.training_loss(x, y, self.task, **extra)


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
    replay: bool = False,
    ids: torch.Tensor | None = None,
    watch: FirstNonFinite | None = None,
    features: bool = False,
    trainer: TrainerConfig | None = None,
) -> StepOut:
    """One optimisation step on a raw uint8 batch: device augmentation, loss, backward, the method's gradient
    surgery, clipping, the optimizer step, the method's constraints, and the batch offered to a reservoir memory.
    Returns the detached loss (no host sync). ``model``: the :class:`TaskLoss` to run (DDP-wrapped in a multi-process
    run, where this rank trains on its share of the batch, its loss weighted so that the averaged gradients are the
    whole batch's). ``mixing``: the phase's :meth:`Runtime.mixup` (built once per phase, not per step). ``replay``:
    draw the method's memory batches (augmented like the current batch) and hand them to its loss. ``ids``: the rows'
    positions in the phase's data, for a method that :meth:`~clbench.methods.Method.takes_ids`. ``watch``: records
    the loss and its logged terms at the phase's first non-finite step. ``features``: the batch is drawn features (a
    ``features`` phase), handed to the loss as they are and never to a memory. ``trainer``: the phase's settings (its
    gradient clipping), the run's by default."""
    labels = y
    part, weight = rt.ranks.shard(len(y))
    method.batch_share = (len(y), part)
    if features:
        x = x_raw[part]
    elif (
        mixing is not None and len(y) % 2 == 0
    ):  # mixed over the whole batch, so each rank's share is one process's rows
        x, y = mixing(rt.train_tf(x_raw), y - task.offset)  # soft targets over the task's classes
        x = x[part]
    else:  # an odd last batch is not mixed (timm's Mixup pairs images)
        x = rt.train_tf(x_raw, part)
    memory = method.memory
    stores = not features and memory is not None and memory.sampler in STEP_SAMPLERS
    if stores and memory.sampler in STORED_FIRST:  # L2P's buffer: the batch's chosen images go in before the draw
        offer(method, task, rt, x_raw, labels, view=x)
    extra: dict[str, Any] = {"replay": draw_replay(method, rt, len(y))} if replay else {}
    if ids is not None:
        extra["ids"] = ids[part]
    with rt.autocast:
        y = y[part]
        loss, logs = model(x, y, **extra) if model is not None else method.training_loss(x, y, task, **extra)
    if watch is not None:
        watch.update(loss, logs)
    if weight != 1.0:
        loss = loss * weight
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    method.after_backward(task)
    clip = (trainer or rt.cfg.trainer).grad_clip
    if clip:
        torch.nn.utils.clip_grad_norm_(params, clip)
    optimizer.step()
    method.after_step(task)
    if stores and memory.sampler not in STORED_FIRST:  # the reservoir: after the update (DER++'s logits are its step's)
        offer(method, task, rt, x_raw, labels, view=x)
    return loss.detach(), logs


def draw_replay(method: Method, rt: Runtime, current: int) -> tuple[Replay, ...]:
    """The method's ``replay_draws`` independent draws of memory images, each augmented as a training batch (a memory
    of augmented views: as stored) (this rank's rows of it), with their labels and stored logits: :func:`replay_rows`
    for a full batch, proportionally fewer for an epoch's last, smaller one (``current`` rows), so that the ranks of a
    multi-process run hold the same share of both and the averaged gradients are the whole batch's (mammoth draws
    ``minibatch_size`` whatever the batch: a stated departure)."""
    memory = method.memory
    assert memory is not None
    rows = max(1, replay_rows(rt.cfg) * current // rt.cfg.trainer.batch_size)
    part, _ = rt.ranks.shard(rows)
    out = []
    for _ in range(method.replay_draws):
        slots = memory.draw(rows)
        stored = (memory.logits[slots][part], memory.width[slots][part]) if memory.keeps_logits else (None, None)
        images = memory.images[slots][part] if memory.augmented else rt.train_tf(memory.images[slots], part)
        out.append(Replay(images, memory.labels[slots][part], *stored))
    return tuple(out)


def offer(
    method: Method, task: Task, rt: Runtime, x_raw: torch.Tensor, labels: torch.Tensor, *, view: torch.Tensor
) -> None:
    """Offer the whole global batch to the step sampler: un-augmented as stored (``x_raw``), or the augmented view this
    rank trains on (``view``, its rows) where the memory keeps that; with the logits the method kept of its rows
    (DER++). A rank of a multi-process run holds only its rows of the augmented view, or, reading from the on-disk
    cache, of the raw batch (the rest zeros): the ranks gather the views and the logits of their rows and complete the
    raw batch (an element-wise max)."""
    memory = method.memory
    assert memory is not None
    images, logits = (view if memory.augmented else x_raw), method.stored_logits
    if rt.ranks.size > 1:
        if memory.augmented:
            images = rt.ranks.gather_rows(view, len(labels))
        elif rt.streamed:
            images = rt.ranks.complete_rows(x_raw)
        if logits is not None:
            logits = rt.ranks.gather_rows(logits, len(labels))
    memory.insert(images, labels, task.id, logits)


class StepGraph:
    """A training step captured as one CUDA graph. :meth:`replay` copies a batch into the captured input buffers and
    replays every kernel of the step; its outputs (the loss and the logged values) are the captured tensors,
    overwritten by each replay."""

    def __init__(
        self,
        step: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], StepOut],
        x_raw: torch.Tensor,
        y: torch.Tensor,
        ids: torch.Tensor | None = None,
        *,
        replays: bool = False,
    ) -> None:
        self.x, self.y, self.replays = x_raw.clone(), y.clone(), replays
        self.ids = ids.clone() if ids is not None else None
        self.graph = torch.cuda.CUDAGraph()
        # thread_local: CUDA calls of other threads (the stream loader's pin-memory thread) do not break the capture;
        # fail_on_recompile: a compile inside the capture (benchmarking kernels, syncing) is a clean Python error.
        stance = (
            torch.compiler.set_stance("fail_on_recompile") if hasattr(torch.compiler, "set_stance") else nullcontext()
        )
        with stance, torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
            self.out = step(self.x, self.y, self.ids)

    def replay(self, x_raw: torch.Tensor, y: torch.Tensor, ids: torch.Tensor | None = None) -> StepOut:
        self.x.copy_(x_raw)
        self.y.copy_(y)
        if self.ids is not None and ids is not None:
            self.ids.copy_(ids)
        self.graph.replay()
        return self.out


class Stepper:
    """The training steps of one phase of ``task``, eager, compiled and/or replayed as a CUDA graph as
    ``rt.accel`` says (see the module's docstring). Call it with each raw batch; it returns the detached loss and the
    method's logged values, without a host sync."""

    def __init__(
        self,
        method: Method,
        task: Task,
        rt: Runtime,
        optimizer: torch.optim.Optimizer,
        mixing: Mixup | None = None,
        *,
        trainer: TrainerConfig | None = None,
        features: bool = False,
    ) -> None:
        self.method, self.task, self.rt, self.optimizer, self.mixing = method, task, rt, optimizer, mixing
        self.trainer, self.features = trainer or rt.cfg.trainer, features  # the phase's settings; drawn features
        self.params = [p for g in optimizer.param_groups for p in g["params"]]
        self.full = self.trainer.batch_size
        compiled = None
        if rt.accel.compile:
            torch._dynamo.reset()  # a phase's graph is new (its head, masks, optimizer groups): drop the last ones
            compiled = torch.compile(method.training_loss, dynamic=False)
        rows = len(range(self.full)[rt.ranks.shard(self.full)[0]])
        self.loss = TaskLoss(method, task, compiled, rows, self.stop_compiling)
        self.model = rt.ranks.wrap(self.loss, rt.device) if rt.ranks.size > 1 else self.loss
        self.graph: StepGraph | None = None
        self.replay = False  # whether the current step draws from the memory
        self.warm = 0
        self.side = torch.cuda.Stream(rt.device) if rt.accel.graphs else None
        self.watch = FirstNonFinite(rt.device)  # what went non-finite first, for the NaN guard's message

    def __call__(self, x_raw: torch.Tensor, y: torch.Tensor, ids: torch.Tensor | None = None) -> StepOut:
        """One step on a raw batch (``ids``: its rows' positions in the phase's data, where the method takes them)."""
        memory = self.method.memory
        stores = not self.features and memory is not None and memory.sampler in STEP_SAMPLERS
        if stores and memory.sampler in STORED_FIRST:
            memory.offer_counted(len(y))  # the host's count of what the step stores before it draws
        replay = self.method.draws_replay(self.task) and memory is not None and not memory.empty
        self.replay = replay and not self.features
        out = self.step(x_raw, y, ids)
        if stores and memory.sampler not in STORED_FIRST:
            memory.offer_counted(len(y))  # the host's count of what the step offered (a graph replay runs no Python)
        return out

    def step(self, x_raw: torch.Tensor, y: torch.Tensor, ids: torch.Tensor | None) -> StepOut:
        """One step: eager, on the warm-up side stream, captured, or replayed (a captured step replays only batches
        of its size that draw from the memory as it did)."""
        if not self.rt.accel.graphs or len(y) != self.full or (self.graph and self.graph.replays != self.replay):
            out = self.eager(x_raw, y, ids)
            if self.graph is not None:
                self.optimizer.zero_grad(set_to_none=True)  # the graph keeps its own gradient buffers
            return out
        if self.graph is not None:
            return self.graph.replay(x_raw, y, ids)
        if self.warm < WARMUP_STEPS:
            self.warm += 1
            return self.on_side_stream(x_raw, y, ids)
        try:  # captured without the eager fallback's retry: a retried step would be recorded twice
            self.graph = StepGraph(self.take, x_raw, y, ids, replays=self.replay)
        except torch.OutOfMemoryError:
            raise
        except RuntimeError as err:  # a failed capture leaves the allocator and the streams unsafe to go on with
            raise GraphCaptureError(
                f"The training step of task {self.task.id} could not be captured as a CUDA graph ({first_line(err)}). "
                "Run the same command with trainer.cuda_graphs=false (and resume=true to go on from the last "
                "checkpoint)."
            ) from err
        return self.graph.replay(x_raw, y, ids)

    def eager(self, x_raw: torch.Tensor, y: torch.Tensor, ids: torch.Tensor | None = None) -> StepOut:
        """:func:`train_step` through the (compiled) task loss. Compiling the forward is done, or fails over to eager,
        in :class:`TaskLoss`; compiling the backward happens at the first ``backward()``, and a failure there falls
        back to eager and retakes the step (its augmentation drawn anew)."""
        record, before, start = self.rt.log, counters["stats"]["unique_graphs"], time.perf_counter()
        try:
            out = self.take(x_raw, y, ids)
        except torch.OutOfMemoryError:
            raise
        except Exception as err:  # compiling the backward failed (an eager step's own error is raised again below)
            if self.loss.compiled is None:
                raise
            self.stop_compiling(err)
            return self.take(x_raw, y, ids)
        new = counters["stats"]["unique_graphs"] - before
        if new:
            record.compiled_graphs += new
            record.compile_s += time.perf_counter() - start
        return out

    def take(self, x_raw: torch.Tensor, y: torch.Tensor, ids: torch.Tensor | None = None) -> StepOut:
        return train_step(
            self.method,
            self.task,
            self.rt,
            x_raw,
            y,
            optimizer=self.optimizer,
            params=self.params,
            model=self.model,
            mixing=self.mixing,
            replay=self.replay,
            ids=ids,
            watch=self.watch,
            features=self.features,
            trainer=self.trainer,
        )

    def on_side_stream(self, x_raw: torch.Tensor, y: torch.Tensor, ids: torch.Tensor | None) -> StepOut:
        """An eager warm-up step on a side stream, as CUDA graph capture wants its warm-up."""
        assert self.side is not None
        self.side.wait_stream(torch.cuda.current_stream(self.rt.device))
        with torch.cuda.stream(self.side):
            out = self.eager(x_raw, y, ids)
        torch.cuda.current_stream(self.rt.device).wait_stream(self.side)
        return out

    def stop_compiling(self, err: Exception) -> None:
        self.loss.compiled = None
        self.rt.accel = dataclasses.replace(self.rt.accel, compile=False)
        self.rt.log.compile_failure = first_line(err)
        say(
            f"[yellow]warning: torch.compile failed ({first_line(err)}); this run trains eagerly from here on "
            "(trainer.compile=false skips the attempt).[/yellow]"
        )

    def close(self) -> None:
        """Drop the captured graph (its memory pool) and the compiled loss, so that nothing of the phase outlives it."""
        self.graph = None
        self.loss.compiled = self.loss.failed = None


def first_line(err: Exception) -> str:
    return f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"[:300]
