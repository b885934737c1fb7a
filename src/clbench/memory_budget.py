"""What a rehearsal memory's budget must satisfy on a benchmark and a device, decided from the config and the
benchmark's class counts before any work (a budget found wanting at task 3, or an allocator error mid-run, is refused
here with the reason and the limit):

- the balanced and herding samplers keep ``per_class``, or ``size // classes seen``, images of every seen class: at
  least one each at every task, plus what BiC holds out of each class for its bias stage (⌊holdout · quota⌋, at least
  one), which must also be fewer than the class's training images;
- the memory's buffers (images, labels, task ids, priorities, sources, validation flags, DER++'s logits) fit in the
  memory where they are held (the training device, or the host's where they are pinned);
- a training step's replayed images (``memory.batch_size`` a draw) fit on the training device.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from clbench.config import MemoryConfig, require

QUOTA_SAMPLERS = ("balanced", "herding")  # the samplers that keep a quota of every seen class


def class_quota(per_class: int | None, capacity: int, seen: int) -> int:
    """Images a class keeps once ``seen`` classes have been seen (balanced and herding samplers): ``per_class``, or
    an equal share of a fixed total."""
    return per_class if per_class is not None else capacity // seen


def held_out(holdout: float, quota: int) -> int:
    """Of a class's ``quota`` images in memory, those held out for validation: ⌊holdout · quota⌋, at least one (BiC's
    code: ⌊0.1 · nb_proto⌋ of its nb_proto exemplars a class); none without a holdout."""
    return max(1, int(holdout * quota)) if holdout else 0


def capacity_of(config: MemoryConfig, classes: int) -> int:
    """The memory's slots: ``size``, or ``per_class`` x the benchmark's classes."""
    return config.size if config.size is not None else config.per_class * classes


def largest_quota(holdout: float, images: int) -> int:
    """The largest quota whose held-out share leaves a class of ``images`` training images one to train on (0: none)."""
    if images <= 1:
        return 0
    quota = int(images / holdout)
    while quota > 0 and held_out(holdout, quota) >= images:
        quota -= 1
    while held_out(holdout, quota + 1) < images:
        quota += 1
    return quota


def memory_bytes(capacity: int, image_shape: tuple[int, ...], classes: int, logits: bool) -> int:
    """Bytes of a memory of ``capacity`` slots and its scratch row (:class:`clbench.memory.Memory`'s buffers): uint8
    images, four int64 per slot (label, task, rank, source), a validation flag, and DER++'s fp32 logits over every
    class with their int64 width."""
    per_slot = math.prod(image_shape) + 4 * 8 + 1 + (classes * 4 + 8 if logits else 0)
    return (capacity + 1) * per_slot


@dataclass(frozen=True)
class Budget:
    """A memory config on a benchmark: ``class_sizes``, the training images of each class of each task (task order);
    ``who``, the method (for the messages); ``holdout``, the share of each class's quota it holds out (BiC)."""

    config: MemoryConfig
    class_sizes: list[list[int]]
    who: str
    holdout: float = 0.0

    @property
    def key(self) -> str:
        return "per_class" if self.config.per_class is not None else "size"

    @property
    def value(self) -> int:
        return getattr(self.config, self.key)

    @property
    def classes(self) -> int:
        return sum(map(len, self.class_sizes))

    @property
    def seen(self) -> list[int]:
        """The classes seen once each task has started."""
        return list(itertools.accumulate(map(len, self.class_sizes)))

    @property
    def quotas(self) -> list[int]:
        """A class's quota at each task (balanced and herding samplers)."""
        return [class_quota(self.config.per_class, capacity_of(self.config, self.classes), n) for n in self.seen]

    def refuse_unless(self, ok: bool, allowed: str) -> None:
        require(ok, f"memory.{self.key}", self.value, allowed)

    def check_quotas(self, sampler: str) -> None:
        """Refuse a budget the balanced or herding sampler cannot keep at some task."""
        if sampler not in QUOTA_SAMPLERS:
            return
        fewest = next(q for q in range(1, 3) if q - held_out(self.holdout, q) >= 1)  # 1, or 2 with a holdout < 1
        keeps = (
            f"{self.who} holds ⌊{self.holdout:g} x the quota⌋ (at least one) of each class's images in memory out "
            "for its bias stage and needs one more to train on"
            if self.holdout
            else f"the {sampler} sampler keeps {'per_class' if self.key == 'per_class' else 'size // classes seen'} "
            "images of each seen class, at least one"
        )
        least = fewest if self.key == "per_class" else fewest * self.classes
        self.refuse_unless(
            all(q - held_out(self.holdout, q) >= 1 for q in self.quotas),
            f"at least {least} on this benchmark's {self.classes} classes: {keeps}",
        )
        if self.holdout:
            self.check_holdout()

    def check_holdout(self) -> None:
        """Each new class must have more training images than the share of its quota it holds out (it trains on the
        rest)."""
        smallest, quotas = [min(sizes) for sizes in self.class_sizes], self.quotas
        worst = min(range(len(quotas)), key=lambda t: smallest[t] - held_out(self.holdout, quotas[t]))
        share = held_out(self.holdout, quotas[worst])
        if share < smallest[worst]:
            return
        largest = [largest_quota(self.holdout, n) for n in smallest]
        most = (
            min(largest)
            if self.key == "per_class"
            else min((q + 1) * n - 1 for q, n in zip(largest, self.seen, strict=True))
        )
        self.refuse_unless(
            False,
            (f"at most {most} on this benchmark" if most >= 1 else "none on this benchmark")
            + f": {self.who} holds ⌊{self.holdout:g} x {quotas[worst]}⌋ = {share} images of each class of task "
            f"{worst} out of training for its bias stage, and that task's smallest class has {smallest[worst]} "
            "training images",
        )

    def check_allocation(self, image_shape: tuple[int, ...], *, logits: bool, free: int, where: str) -> int:
        """Refuse a memory whose buffers do not fit in the ``free`` bytes of ``where``; returns its bytes."""
        capacity = capacity_of(self.config, self.classes)
        need = memory_bytes(capacity, image_shape, self.classes, logits)
        slots = free // memory_bytes(0, image_shape, self.classes, logits) - 1
        most = max(slots // self.classes if self.key == "per_class" else slots, 0)
        self.refuse_unless(
            need <= free,
            f"at most {most} here: a memory of {capacity} images of {'x'.join(map(str, image_shape))} takes "
            f"{need / 2**30:.3g} GiB, and {where} has {free / 2**30:.3g} GiB free",
        )
        return need


def check_replay(rows: int, *, draws: int, image_shape: tuple[int, ...], img_size: int, free: int, where: str) -> None:
    """Refuse replayed batches (``draws`` draws of ``rows`` images a step) whose images alone do not fit in the
    ``free`` bytes of the training device: each replayed image is gathered (uint8) and augmented to fp32 at the
    backbone's ``img_size`` before the model sees it."""
    per_image = math.prod(image_shape) + 3 * img_size * img_size * 4
    need = draws * rows * per_image
    require(
        need <= free,
        "memory.batch_size",
        rows,
        f"at most {free // (draws * per_image)} here: {draws} draw(s) of {rows} images a step take "
        f"{need / 2**30:.3g} GiB before the model runs (uint8, then fp32 at {img_size} px), and {where} has "
        f"{free / 2**30:.3g} GiB free",
    )
