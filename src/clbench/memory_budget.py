"""What a rehearsal memory's budget must satisfy on a benchmark and a device, decided from the config and the
benchmark's class counts before any work (a budget found wanting at task 3, or an allocator error mid-run, is refused
here with the reason and the limit):

- the balanced and herding samplers keep ``per_class``, or ``size // classes seen``, images of every seen class: at
  least one each at every task; BiC keeps ⌈share⌉ − ⌈0.1 · share⌉ of them to train on and holds ⌊0.1 · share⌋ (at
  least one) out for its bias stage, which must be fewer than a new class's training images (the counting rules are
  here, and :class:`clbench.memory.Memory` follows them);
- the memory's buffers (images, labels, task ids, priorities, sources, validation flags, DER++'s logits) fit in the
  memory where they are held (the training device, or the host's where they are pinned);
- a training step's replayed images (``memory.batch_size`` a draw) fit on the training device.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction

from clbench.config import MemoryConfig, require

QUOTA_SAMPLERS = ("balanced", "herding")  # the samplers that keep a quota of every seen class


def class_share(per_class: int | None, capacity: int, classes: int) -> Fraction:
    """The images a class may hold when ``classes`` classes share the memory: ``per_class``, or ``capacity`` /
    classes (not rounded: the task samplers round as their codes do)."""
    return Fraction(per_class) if per_class is not None else Fraction(capacity, classes)


def validation_count(holdout: Fraction, share: Fraction) -> int:
    """Of a class's ``share``, the images held out for validation: ⌊holdout · share⌋, at least one (BiC's code:
    nb_val_itera = ⌊0.1 · K / n⌋ with K images in all and n classes, imagenet_main.py L439; clbench keeps one where
    that is 0, so that a small memory still has a bias stage); none without a holdout."""
    return max(1, math.floor(holdout * share)) if holdout else 0


def exemplar_count(holdout: Fraction, share: Fraction) -> int:
    """Of a class's ``share``, the training images a task sampler keeps: ⌊share⌋ (iCaRL's m = K // n), or with a
    validation share BiC's ⌈K / n⌉ − ⌈0.1 · K / n⌉ (imagenet_main.py L488-489), at most ⌊share⌋ less the validation
    images (so that the memory never holds more than K)."""
    if not holdout:
        return math.floor(share)
    official = math.ceil(share) - math.ceil(holdout * share)
    return min(official, math.floor(share) - validation_count(holdout, share))


def capacity_of(config: MemoryConfig, classes: int) -> int:
    """The memory's slots: ``size``, or ``per_class`` x the benchmark's classes."""
    return config.size if config.size is not None else config.per_class * classes


def first_true(ok: Callable[[int], bool], lo: int, hi: int) -> int | None:
    """The least value in ``lo .. hi`` where the monotone ``ok`` (false, then true) holds; None where it never does."""
    if not ok(hi):
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if ok(mid) else (mid + 1, hi)
    return lo


def memory_bytes(capacity: int, image_shape: tuple[int, ...], classes: int, logits: bool, image_bytes: int = 1) -> int:
    """Bytes of a memory of ``capacity`` slots and its scratch row (:class:`clbench.memory.Memory`'s buffers): images
    (uint8 as the benchmark stores them, or ``image_bytes`` 4: float32 augmented views), four int64 per slot (label,
    task, rank, source), a validation flag, and DER++'s fp32 logits over every class with their int64 width."""
    per_slot = image_bytes * math.prod(image_shape) + 4 * 8 + 1 + (classes * 4 + 8 if logits else 0)
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

    def exemplars(self, value: int) -> list[int]:
        """The training images a class keeps at each task, the budget set to ``value`` (balanced, herding)."""
        per_class = value if self.key == "per_class" else None
        capacity = value * self.classes if self.key == "per_class" else value
        return [exemplar_count(self.share, class_share(per_class, capacity, n)) for n in self.seen]

    def validations(self, value: int) -> list[int]:
        """The validation images each new class of each task holds out of its training, the budget set to ``value``:
        counted over the classes before the task (the first task's over its own), as BiC's bias stage takes them."""
        per_class = value if self.key == "per_class" else None
        capacity = value * self.classes if self.key == "per_class" else value
        before = [n - len(sizes) or n for n, sizes in zip(self.seen, self.class_sizes, strict=True)]
        return [validation_count(self.share, class_share(per_class, capacity, n)) for n in before]

    @property
    def share(self) -> Fraction:
        return Fraction(str(self.holdout))

    def refuse_unless(self, ok: bool, allowed: str) -> None:
        require(ok, f"memory.{self.key}", self.value, allowed)

    def check_quotas(self, sampler: str) -> None:
        """Refuse a budget the balanced or herding sampler cannot keep at some task."""
        if sampler not in QUOTA_SAMPLERS:
            return
        keeps = (
            f"{self.who} holds ⌊{self.holdout:g} x a class's share⌋ (at least one) of its images in memory out for "
            f"its bias stage and keeps ⌈share⌉ − ⌈{self.holdout:g} x share⌉ to train on, at least one"
            if self.holdout
            else f"the {sampler} sampler keeps {'per_class' if self.key == 'per_class' else 'size // classes seen'} "
            "images of each seen class, at least one"
        )

        def enough(value: int) -> bool:
            return min(self.exemplars(value)) >= 1

        least = first_true(enough, 1, 4 * (1 if self.key == "per_class" else self.classes))
        self.refuse_unless(enough(self.value), f"at least {least} on this benchmark's {self.classes} classes: {keeps}")
        if self.holdout:
            self.check_holdout()

    def check_holdout(self) -> None:
        """Each new class must have more training images than the validation images it holds out (it trains on the
        rest)."""
        smallest = [min(sizes) for sizes in self.class_sizes]

        def fits(value: int) -> bool:
            return all(v < n for v, n in zip(self.validations(value), smallest, strict=True))

        if fits(self.value):
            return
        counts = self.validations(self.value)
        worst = min(range(len(counts)), key=lambda t: smallest[t] - counts[t])
        too_many = first_true(lambda value: not fits(value), 1, self.value)
        most = (too_many or 1) - 1
        self.refuse_unless(
            False,
            (f"at most {most} on this benchmark" if most >= 1 else "none on this benchmark")
            + f": {self.who} holds {counts[worst]} images of each class of task {worst} out of training for its bias "
            f"stage (⌊{self.holdout:g} x a class's share⌋), and that task's smallest class has {smallest[worst]} "
            "training images",
        )

    def check_allocation(self, image_shape: tuple[int, ...], *, logits: bool, free: int, where: str) -> int:
        """Refuse a memory whose buffers do not fit in the ``free`` bytes of ``where``; returns its bytes."""
        capacity = capacity_of(self.config, self.classes)
        image_bytes = 4 if self.config.view == "augmented" else 1
        need = memory_bytes(capacity, image_shape, self.classes, logits, image_bytes)
        slots = free // memory_bytes(0, image_shape, self.classes, logits, image_bytes) - 1
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
