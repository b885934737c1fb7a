"""The rehearsal memory: a fixed budget of training images, kept as the benchmark stores them (uint8; or, with
``memory.view=augmented``, as the step that stored them trained on them, float32), with their labels, task ids and
what a method keeps per sample (DER++'s logits), filled by the sampler of the method's paper and drawn from on the
training device.

Samplers:

- ``reservoir`` (ER, DER++; mammoth's ``Buffer``, Vitter's algorithm R): every image of every training step is a
  candidate, inserted after the step's optimizer update. The n-th image seen (0-based) takes slot n while the memory
  is not full, else slot j ~ U{0..n} if j < capacity, else it is dropped: each of the first N images is kept with
  probability min(1, capacity / N). Vectorised over the batch on the device (no host sync; a CUDA graph replays it):
  two images of one batch that draw the same slot resolve to the later one, as the sequential rule does.
- ``uniform`` (L2P-R; google-research/l2p ``libml/continual_buffer.py``): each task owns per_class x its classes
  slots, filled with the images at that many positions drawn uniformly from the first ⌊N / B⌋ x B of its stream (its
  first epoch's full batches), as the steps meet them and before they draw (``gen_batch_index``, ``add_example``);
  replays include the current task's images as soon as they are stored (the code's ``include_new_task``), and draw
  with replacement while fewer than a draw are held (``get_random_batch``).
- ``balanced`` (class-balanced random, iCaRL's shrink): after each task, every class of the task keeps a
  random subset of its images; with a fixed ``size``, older classes give up their last-chosen slots so that every
  seen class holds ``size // seen classes``.
- ``herding`` (BiC, iCaRL): as ``balanced``, the subset chosen by herding on the model's features: greedily the image
  that brings the mean of the chosen features closest to the class mean; a shrink keeps the first chosen (iCaRL), or
  with ``memory.reselect`` the old classes' images are chosen again by herding on the current model's features among
  their own (BiC's code).

- ``greedy`` (GDumb): the task's images as a stream in a random order; an image of a class not in memory, or of a
  class holding fewer than ``capacity // classes in memory``, is stored, evicting (when full) a random image of the
  class holding most (ties broken at random); otherwise it is dropped. No task boundary is needed.

A method that holds a validation share out (BiC, ``holdout`` 0.1) keeps BiC's counts: with K images and n classes,
⌈K / n⌉ − ⌈0.1 · K / n⌉ training and ⌊0.1 · K / n⌋ validation images a class (:meth:`Memory.exemplar_count`,
:meth:`Memory.validation_count`); a new class's validation images are drawn at its task's start, counted over the old
classes (what that task's bias stage takes of every class), and left out of its training.

Budget (``memory.per_class`` or ``memory.size``): ``per_class`` keeps exactly that many images of each seen class (the
memory grows to per_class x the benchmark's classes, L2P Table 1's buffers); ``size`` is a fixed total from the first
task on. The reservoir, which knows no classes, holds per_class x classes from the start.

Draws are made on the device with the default generator, the uniform sampler's positions and the task samplers'
choices on the host with the CPU one (every checkpoint saves both states): a resumed run draws what an uninterrupted
one does. Every rank of a multi-process run inserts the whole global batch and draws the same slots, so the ranks'
memories stay identical.

Where the training images are streamed from the on-disk cache (``data.store=stream``) on CUDA, the memory's images are
held in pinned host memory that the GPU's kernels address in place (zero-copy, through unified virtual addressing):
draws, replays and insertions are the same device operations, still without a host sync and replayable in a CUDA
graph, and the memory takes no GPU memory. Each image a task sampler stores also keeps where it came from (its
position in the benchmark's training data), so a streamed phase can read the memory's images from the cache with the
task's (BiC's first stage, :meth:`Memory.held_split`).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import torch
from torch import nn

from clbench.config import MemoryConfig
from clbench.data import Split, Task
from clbench.data.stream import DiskImages
from clbench.memory_budget import capacity_of, class_share, exemplar_count, validation_count

STORED_FIRST = ("uniform",)  # store before the step draws (L2P's buffer); the reservoir after the optimizer update


@dataclass
class Plan:
    """What a task sampler decided: slots it frees, {slot: (row of the task's training data, rank within its class
    and part, whether it is a held-out validation image)} it fills, and {slot: new rank} of the images it keeps in a
    new order (herding's re-selection)."""

    freed: list[int] = field(default_factory=list)
    taken: dict[int, tuple[int, int, bool]] = field(default_factory=dict)
    ranked: dict[int, int] = field(default_factory=dict)

    def rows(self) -> list[int]:
        """The task's rows the plan stores, sorted (the order :meth:`Memory.write` reads their images in)."""
        return sorted({row for row, _, _ in self.taken.values()})


class Memory(nn.Module):
    """A rehearsal memory of ``capacity`` slots (plus one scratch slot that absorbs dropped insertions). Its tensors
    are buffers of the method that owns it, so the run's checkpoint holds them; the count of images offered is kept
    on the host too, so the loop knows without a sync whether there is anything to replay."""

    def __init__(
        self,
        config: MemoryConfig,
        sampler: str,
        *,
        num_classes: int,
        image_shape: tuple[int, ...],
        logits: bool = False,
        holdout: float = 0.0,
        device: torch.device | str = "cpu",
        host: bool = False,
        batch_size: int = 1,
        longest_task: int = 0,
    ) -> None:
        super().__init__()
        self.sampler, self.per_class, self.num_classes = sampler, config.per_class, num_classes
        self.capacity = capacity_of(config, num_classes)
        self.reselect = config.reselect  # herding: the old classes' images chosen again on the current features
        # ``view=augmented``: each image as the step that stored it trained on it (float32, ``image_shape`` the
        # model's input), replayed as stored; ``raw``: as the benchmark stores it (uint8), augmented at every draw.
        self.augmented = config.view == "augmented"
        self.batch_size = batch_size  # the global training batch (the uniform sampler's first epoch: ⌊N / B⌋ x B)
        dtype = torch.float32 if self.augmented else torch.uint8
        rows = self.capacity + 1  # the last row is scratch
        device = torch.device(device)
        # ``host``: the images in pinned host memory that the CUDA device reads and writes in place; the checkpoint
        # saves and loads them through the host tensor (a copy engine is never handed the mapped address).
        self.host: torch.Tensor | None = None
        if host and device.type == "cuda":
            self.host = torch.zeros((rows, *image_shape), dtype=dtype, pin_memory=True)
            self.register_buffer("images", mapped_on(self.host, device))
            self.register_state_dict_post_hook(_save_host_images)
            self.register_load_state_dict_pre_hook(_load_host_images)
        else:
            self.register_buffer("images", torch.zeros((rows, *image_shape), dtype=dtype, device=device))
        self.register_buffer("labels", torch.full((rows,), -1, dtype=torch.long, device=device))
        self.register_buffer("tasks", torch.full((rows,), -1, dtype=torch.long, device=device))
        # Priority of a slot within its class (balanced, herding): a shrink frees a class's highest ranks first.
        self.register_buffer("rank", torch.zeros(rows, dtype=torch.long, device=device))
        self.register_buffer("offered", torch.zeros((), dtype=torch.long, device=device))  # images offered so far
        # A held-out validation image (BiC): never trained on by the model, only by the bias layer.
        self.register_buffer("validation", torch.zeros(rows, dtype=torch.bool, device=device))
        # Where a task sampler's image came from: its position in the benchmark's training data, all tasks in order
        # (-1: stored by a step sampler, which does not record it).
        self.register_buffer("source", torch.full((rows,), -1, dtype=torch.long, device=device))
        self.holdout = Fraction(str(holdout))  # the share of each class's images in memory held out for validation
        # rows of the current task's training data held out of its training (each class's in the order drawn), and
        # those of them a task sampler has not stored yet (the bias stage before the memory update reads them there)
        self.held_out: list[int] = []
        self.pending: list[int] = []
        self.keeps_logits = logits
        if logits:  # DER++: the logits over the classes seen at insertion, padded to every class, and their width
            self.register_buffer("logits", torch.zeros((rows, num_classes), dtype=torch.float32, device=device))
            self.register_buffer("width", torch.zeros(rows, dtype=torch.long, device=device))
        self.held = 0  # host copy: images held (uniform, task samplers) or offered (reservoir); 0: nothing to replay
        # The uniform sampler: the slot each position of the current task's stream goes to (the scratch row for a
        # position not chosen), and on the host the chosen positions and how many images the task has offered.
        self.register_buffer("slot_of", torch.full((longest_task,), self.capacity, dtype=torch.long, device=device))
        self.chosen: list[int] = []
        self.task_offered = 0

    # ----------------------------------------------------------------------------- state
    @property
    def empty(self) -> bool:
        return self.held == 0

    @property
    def location(self) -> str:
        """Where the images are held: the training device, or pinned host memory that it addresses in place."""
        device = self.images.device
        return f"pinned host memory, read in place by {device}" if self.host is not None else str(device)

    def held_split(self, validation: bool = False, streamed_from: list[Split] | None = None) -> Split:
        """The held training images (GDumb's fit, BiC's first stage) or (``validation``) the held-out validation
        images (BiC's bias stage) and their labels, as a split. ``streamed_from``: the benchmark's training splits
        on disk; the images are then read from there (the rows they came from), to be streamed with a task's."""
        part = (self.labels[: self.capacity] >= 0) & (self.validation[: self.capacity] == validation)
        held = part.nonzero().flatten()
        if streamed_from is None:
            return Split(self.images[held], self.labels[held])
        source = self.source[held].cpu().numpy()
        if (source < 0).any():
            raise RuntimeError(f"the {self.sampler} sampler does not record where its images came from")
        return Split(DiskImages.cat([split.x for split in streamed_from])[source], self.labels[held])

    def get_extra_state(self) -> dict[str, Any]:
        return {
            "held": self.held,
            "chosen": self.chosen,
            "task_offered": self.task_offered,
            "held_out": self.held_out,
            "pending": self.pending,
        }

    def problems(self, tasks: list[Task]) -> list[str]:
        """What a restored memory holds that no run writes: a label outside the benchmark's classes or not of its
        slot's task, and a count of held images its labels contradict (a task sampler's count is its filled slots; the
        reservoir's, the images offered, fills min(count, capacity) slots; the uniform sampler's, at least its filled
        slots). An empty list where it is consistent."""
        labels, owner = self.labels[: self.capacity].cpu(), self.tasks[: self.capacity].cpu()
        filled = labels >= 0
        out = []
        outside = labels[(labels < -1) | (labels >= self.num_classes)].unique()
        if len(outside):
            out.append(f"memory labels {outside[:5].tolist()} outside -1 (empty) .. {self.num_classes - 1}")
        else:
            lo = torch.tensor([t.offset for t in tasks])
            hi = lo + torch.tensor([t.num_classes for t in tasks])
            known = filled & (owner >= 0) & (owner < len(tasks))
            slot_task = owner.clamp(0, len(tasks) - 1)
            stray = filled & (~known | (labels < lo[slot_task]) | (labels >= hi[slot_task]))
            if stray.any():
                out.append(f"{int(stray.sum())} memory images whose label is not of the task recorded with it")
        count, n = self.held, int(filled.sum())
        expected = {"reservoir": min(count, self.capacity) == n, "uniform": count >= n}
        if not expected.get(self.sampler, count == n):
            out.append(f"a memory count of {count} held images where its labels fill {n} of its slots")
        return out

    def set_extra_state(self, state: dict[str, Any]) -> None:
        self.held = int(state["held"])
        self.chosen = [int(p) for p in state.get("chosen", [])]
        self.task_offered = int(state.get("task_offered", 0))
        self.held_out = [int(r) for r in state.get("held_out", [])]
        self.pending = [int(r) for r in state.get("pending", [])]

    def share(self, classes: int) -> Fraction:
        """The images a class may hold when ``classes`` classes share the memory (:func:`class_share`)."""
        return class_share(self.per_class, self.capacity, classes)

    def validation_count(self, classes: int) -> int:
        """Of a class's :meth:`share`, the images held out for validation (:func:`validation_count`)."""
        return validation_count(self.holdout, self.share(classes))

    def exemplar_count(self, classes: int) -> int:
        """Of a class's :meth:`share`, the training images a task sampler keeps (:func:`exemplar_count`)."""
        return exemplar_count(self.holdout, self.share(classes))

    def start_task(self, task: Task, labels: torch.Tensor) -> None:
        """At a task's start (``labels``: its training images' labels, on the host): the validation images held out of
        its training, a random :meth:`validation_count` of each new class, counted over the old classes as BiC's code
        does for its bias stage (imagenet_main.py L439; the first task's over its own classes, what the second task's
        bias stage takes of them); and the uniform sampler's choice for the task (:meth:`choose_positions`)."""
        if self.holdout:
            count = self.validation_count(task.offset or task.num_classes)
            picks = [(labels == c).nonzero().flatten() for c in range(task.offset, task.offset + task.num_classes)]
            if any(len(rows) <= count for rows in picks):
                raise ValueError(f"a class of task {task.id} has too few images to hold {count} out for validation")
            self.held_out = [r for rows in picks for r in rows[torch.randperm(len(rows))[:count]].tolist()]
            self.pending = list(self.held_out)
        if self.sampler == "uniform":
            self.choose_positions(task, len(labels))

    def choose_positions(self, task: Task, images: int) -> None:
        """L2P's buffer (libml/continual_buffer.py ``gen_batch_index``): the task owns per_class x its classes slots
        (a fixed ``size``: its classes' share), filled with the images at that many distinct positions drawn uniformly
        from the first ⌊N / B⌋ x B of its stream (its first epoch's full batches), in stream order as they come."""
        if self.per_class is not None:
            lo, length = self.per_class * task.offset, self.per_class * task.num_classes
        else:
            lo = self.capacity * task.offset // self.num_classes
            length = self.capacity * (task.offset + task.num_classes) // self.num_classes - lo
        valid = min(images // self.batch_size * self.batch_size, len(self.slot_of))
        self.chosen = sorted(torch.randperm(valid)[:length].tolist())
        self.slot_of.fill_(self.capacity)
        if self.chosen:
            at = torch.tensor(self.chosen, device=self.slot_of.device)
            self.slot_of[at] = lo + torch.arange(len(self.chosen), device=self.slot_of.device)
        self.offered.zero_()
        self.task_offered = 0

    # ----------------------------------------------------------------------------- reservoir (in the step)
    def insert(
        self, images: torch.Tensor, labels: torch.Tensor, task_id: int, logits: torch.Tensor | None = None
    ) -> None:
        """Offer a batch to the step sampler (device ops only; ``labels`` global; ``images`` raw, or with
        ``view=augmented`` as the step trained on them). ``logits``: the model's outputs on the batch, over the classes
        seen so far (DER++)."""
        n = len(labels)
        position = self.offered + torch.arange(n, device=labels.device)  # images offered before each one
        if self.sampler == "uniform":  # the task's chosen positions of its first epoch
            inside = position < len(self.slot_of)
            slot = torch.where(inside, self.slot_of[position.clamp(max=max(len(self.slot_of) - 1, 0))], self.capacity)
        else:  # the reservoir: slot n while there is room, else j ~ U{0..n} if j < capacity
            draw = (torch.rand(n, device=labels.device, dtype=torch.float64) * (position + 1)).long()
            slot = torch.where(position < self.capacity, position, draw)
            slot = torch.where(slot < self.capacity, slot, self.capacity)  # dropped: the scratch row
        later = (slot[:, None] == slot[None, :]).triu(1).any(1)  # a later image of the batch takes the same slot
        slot = torch.where(later, self.capacity, slot)
        self.images.index_copy_(0, slot, images.to(self.images.dtype))
        self.labels.index_copy_(0, slot, labels)
        self.tasks.index_fill_(0, slot, task_id)
        if logits is not None:
            padded = torch.zeros((n, self.num_classes), dtype=torch.float32, device=logits.device)
            padded[:, : logits.shape[1]] = logits.float()
            self.logits.index_copy_(0, slot, padded)
            self.width.index_fill_(0, slot, logits.shape[1])
        self.offered += n

    def offer_counted(self, n: int) -> None:
        """The host's count of a step's insertion (called outside the step, which a CUDA graph may replay): the
        images stored (uniform: the chosen positions among the ``n`` offered) or offered (reservoir)."""
        if self.sampler == "uniform":
            start, self.task_offered = self.task_offered, self.task_offered + n
            self.held += bisect.bisect_left(self.chosen, self.task_offered) - bisect.bisect_left(self.chosen, start)
        else:
            self.held += n

    # ----------------------------------------------------------------------------- drawing (in the step)
    def draw(self, n: int) -> torch.Tensor:
        """``n`` slot indices, uniform without replacement among the held images, with replacement for the rows
        beyond what is held (the uniform sampler: for every row while fewer than ``n`` are held, as L2P's
        ``get_random_batch``); device ops only. Only called once something is held."""
        held = self.labels[: self.capacity] >= 0
        keys = torch.rand(self.capacity, device=held.device).masked_fill(~held, 2.0)
        order = keys.argsort()  # held slots first, in random order
        count = held.sum()
        take = torch.arange(n, device=held.device)
        spare = (torch.rand(n, device=held.device) * count).long()
        distinct = take < count
        if self.sampler == "uniform":
            distinct = distinct & (count >= n)
        return order[torch.where(distinct, take, spare)]

    # ----------------------------------------------------------------------------- task samplers (after a task)
    def plan(
        self,
        task: Task,
        labels: torch.Tensor,
        features: torch.Tensor | None = None,
        held_features: torch.Tensor | None = None,
    ) -> Plan:
        """Which of the task's training images (``labels``: their global labels, on the host; ``features``: their
        features, for herding) the memory takes, into which slots, and which slots it frees. Every seen class keeps
        :meth:`exemplar_count` training images and :meth:`validation_count` validation ones: an old class its first
        ones, or (``reselect``, herding) the training images that herding on ``held_features`` (the current model's
        features of the held images, one row a slot) chooses again among its own (BiC's code herds every class of the
        step on the new model's features, imagenet_main.py L493-535). Host-side, once a task; random choices come from
        the default CPU generator (checkpointed), the same on every rank."""
        if self.sampler == "greedy":
            return self._greedy(labels)
        seen = task.offset + task.num_classes
        keep, share = self.exemplar_count(seen), self.validation_count(seen)
        if keep < 1:
            raise ValueError(f"a memory of {self.capacity} images cannot hold one image of each of {seen} classes")
        held = self.labels[: self.capacity].cpu() >= 0
        validation = self.validation[: self.capacity].cpu()
        plan = Plan()
        if self.reselect and task.offset:
            assert held_features is not None, "re-selecting by herding needs the held images' features"
            plan.ranked = self._herd_again(held & ~validation, held_features, keep)
            shrunk = held & ~validation & ~_mask(plan.ranked, self.capacity)
        else:  # each old class keeps its first `keep` training images
            shrunk = held & ~validation & (self.rank[: self.capacity].cpu() >= keep)
        shrunk |= held & validation & (self.rank[: self.capacity].cpu() >= share)  # ... and its first validation ones
        free = (~held | shrunk).nonzero().flatten().tolist()
        plan.freed = shrunk.nonzero().flatten().tolist()
        out = torch.zeros(len(labels), dtype=torch.bool)
        out[self.held_out] = True
        for c in range(task.offset, seen):
            rows = ((labels == c) & ~out).nonzero().flatten()
            if self.sampler == "herding":
                assert features is not None, "herding needs the images' features"
                rows = rows[herding(features[rows].float(), min(keep, len(rows)))]
            else:
                rows = rows[torch.randperm(len(rows))[:keep]]
            for k, row in enumerate(rows.tolist()):
                plan.taken[free.pop(0)] = (row, k, False)
            for k, row in enumerate([r for r in self.held_out if labels[r] == c][:share]):
                plan.taken[free.pop(0)] = (row, k, True)
        return plan

    def _herd_again(self, training: torch.Tensor, features: torch.Tensor, keep: int) -> dict[int, int]:
        """{slot: rank} of the ``keep`` training images of each class in memory (``training``: the slots that hold one)
        that herding on ``features`` chooses among the class's, in the order it chooses them."""
        labels = self.labels[: self.capacity].cpu()
        ranked: dict[int, int] = {}
        for c in labels[training].unique().tolist():
            slots = (training & (labels == c)).nonzero().flatten()
            order = herding(features[slots].float(), min(keep, len(slots)))
            ranked |= {int(slots[i]): k for k, i in enumerate(order.tolist())}
        return ranked

    def _greedy(self, labels: torch.Tensor) -> Plan:
        """GDumb's class-balancing greedy sampler over the task's images in a random stream order."""
        slot_class = self.labels[: self.capacity].tolist()
        by_class: dict[int, list[int]] = {}
        for s, c in enumerate(slot_class):
            if c >= 0:
                by_class.setdefault(c, []).append(s)
        free = [s for s, c in enumerate(slot_class) if c < 0]
        plan = Plan()
        for row in torch.randperm(len(labels)).tolist():
            c = int(labels[row])
            if c in by_class and len(by_class[c]) >= self.capacity // len(by_class):
                continue
            if free:
                s = free.pop(0)
            else:  # full: a random image of the class holding most (ties at random) makes room
                most = max(len(v) for v in by_class.values())
                largest = [k for k, v in by_class.items() if len(v) == most]
                victim = largest[int(torch.randint(len(largest), ()))]
                s = by_class[victim].pop(int(torch.randint(most, ())))
                if not by_class[victim]:
                    del by_class[victim]
                if plan.taken.pop(s, None) is None:
                    plan.freed.append(s)
            by_class.setdefault(c, []).append(s)
            plan.taken[s] = (row, 0, False)
        return plan

    @torch.no_grad()
    def write(self, plan: Plan, images: torch.Tensor, labels: torch.Tensor, task_id: int, *, first: int) -> None:
        """Carry out ``plan``: free its slots, then store ``images[i]`` (and ``labels[i]``) of the i-th of
        :meth:`Plan.rows` in its slot; count what is held. ``first``: the position of the task's first training
        image in the benchmark's training data (where each stored image came from)."""
        if plan.freed:
            self.labels[torch.tensor(plan.freed, device=self.labels.device)] = -1
        if plan.ranked:
            dev = self.rank.device
            ranks = torch.tensor(list(plan.ranked.values()), device=dev)
            self.rank[torch.tensor(list(plan.ranked), device=dev)] = ranks
        if plan.taken:
            at = {row: i for i, row in enumerate(plan.rows())}
            dev = self.labels.device
            slots = torch.tensor(list(plan.taken), device=dev)
            picks = torch.tensor([at[row] for row, _, _ in plan.taken.values()], device=images.device)
            self.images[slots] = images[picks].to(dev)
            self.labels[slots] = labels[picks].to(dev)
            self.tasks[slots] = task_id
            self.rank[slots] = torch.tensor([k for _, k, _ in plan.taken.values()], device=dev)
            self.validation[slots] = torch.tensor([v for _, _, v in plan.taken.values()], device=dev)
            self.source[slots] = torch.tensor([first + row for row, _, _ in plan.taken.values()], device=dev)
        self.held = int((self.labels[: self.capacity] >= 0).sum())
        self.pending = []  # the task's validation images are the memory's now (those it keeps)

    # ----------------------------------------------------------------------------- bookkeeping
    def storage(self) -> dict[str, Any]:
        """What the memory holds: samples, the bytes of each part as held, and the images of each class."""
        held = self.labels[: self.capacity] >= 0
        samples = int(held.sum())
        image_bytes = math.prod(self.images.shape[1:]) * self.images.element_size()
        counts = torch.bincount(self.labels[: self.capacity][held], minlength=self.num_classes).tolist()
        return {
            "sampler": self.sampler,
            "capacity": self.capacity,
            "view": "augmented" if self.augmented else "raw",
            "held_in": self.location,
            "samples": samples,
            "bytes_images": samples * image_bytes,
            "bytes_labels": samples * self.labels.element_size(),
            "bytes_task_ids": samples * self.tasks.element_size(),
            "bytes_logits": samples * self.num_classes * 4 if self.keeps_logits else 0,
            "per_class_counts": counts,
            "validation_samples": int((held & self.validation[: self.capacity]).sum()),
        }


def _mask(slots: dict[int, int], length: int) -> torch.Tensor:
    """A boolean mask of ``length`` that is True at ``slots``' keys."""
    out = torch.zeros(length, dtype=torch.bool)
    out[list(slots)] = True
    return out


def herding(features: torch.Tensor, k: int) -> torch.Tensor:
    """iCaRL's herding (Rebuffi et al. 2017, Alg. 4; BiC's exemplar selection): ``k`` row indices of ``features``
    (n, d), chosen greedily so that the mean of the first i chosen is the closest (L2) to the mean of all rows, for
    every i; no row twice."""
    mu = features.mean(0)
    total = torch.zeros_like(mu)
    taken = torch.zeros(len(features), dtype=torch.bool, device=features.device)
    out = []
    for i in range(1, k + 1):
        distance = (mu - (total + features) / i).norm(dim=1).masked_fill(taken, float("inf"))
        pick = int(distance.argmin())
        out.append(pick)
        taken[pick] = True
        total += features[pick]
    return torch.tensor(out, dtype=torch.long)


TYPESTR = {torch.uint8: "|u1", torch.float32: "<f4"}  # the CUDA array interface's names of the memory's dtypes


class _MappedHost:
    """A pinned host tensor described by the CUDA array interface (its address is valid on the device: unified
    virtual addressing), for :func:`torch.as_tensor` to wrap as a CUDA tensor without a copy; the wrapper keeps this
    object, and so the host tensor, alive."""

    def __init__(self, host: torch.Tensor) -> None:
        self.host = host
        self.__cuda_array_interface__ = {
            "shape": tuple(host.shape),
            "typestr": TYPESTR[host.dtype],
            "data": (host.data_ptr(), False),
            "version": 2,
        }


def mapped_on(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` (uint8 or float32, pinned) as a tensor on CUDA ``device`` that aliases it: kernels read and write host
    memory."""
    assert host.is_pinned() and host.dtype in TYPESTR and host.is_contiguous()
    mapped = torch.as_tensor(_MappedHost(host), device=device)
    if mapped.data_ptr() != host.data_ptr():  # as_tensor copied: the host memory was pinned for another device
        raise RuntimeError(f"pinned host memory could not be mapped on {device}: it was pinned for another device")
    return mapped


def _save_host_images(module: Memory, state: dict[str, Any], prefix: str, _metadata: Any) -> None:
    """The checkpoint holds the host tensor behind the mapped images (a CPU tensor), not the alias."""
    state[prefix + "images"] = module.host


def _load_host_images(module: Memory, state: dict[str, Any], prefix: str, *_: Any) -> None:
    """Loading copies the saved images into the host tensor; the alias then stands in for them (a copy to itself)."""
    key = prefix + "images"
    if key in state:
        assert module.host is not None
        module.host.copy_(state[key])
        state[key] = module.images
