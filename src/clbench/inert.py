"""Settings that change nothing in a run, said at its start: a sweep over such a key would otherwise give equal
results without a word (e.g. a warm-up longer than the training, or ``trainer.momentum`` with AdamW)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from operator import attrgetter

from clbench.config import RunConfig


@dataclass(frozen=True)
class Unused:
    """``key`` has no effect when ``unused_when`` holds for the values of the settings ``given``."""

    key: str
    given: tuple[str, ...]
    unused_when: Callable[..., bool]

    def why(self, cfg: RunConfig) -> str | None:
        """The settings that make ``key`` inert in ``cfg`` (e.g. ``trainer.optimizer=adamw``), or None."""
        values = [attrgetter(name)(cfg) for name in self.given]
        if not self.unused_when(*values):
            return None
        return " and ".join(f"{name}={value}" for name, value in zip(self.given, values, strict=True))


UNUSED = [
    Unused("trainer.momentum", ("trainer.optimizer",), lambda optimizer: optimizer != "sgd"),
    Unused("trainer.lr_decay", ("trainer.schedule",), lambda schedule: schedule not in ("exponential", "multistep")),
    Unused("trainer.milestones", ("trainer.schedule",), lambda schedule: schedule != "multistep"),
    Unused("trainer.schedule_steps", ("trainer.schedule",), lambda schedule: schedule != "cosine"),
    Unused("trainer.cosine_epochs", ("trainer.schedule",), lambda schedule: schedule != "cosine"),
    Unused("trainer.plateau_patience", ("trainer.schedule",), lambda schedule: schedule != "plateau"),
    Unused("trainer.plateau_factor", ("trainer.schedule",), lambda schedule: schedule != "plateau"),
    Unused(
        "trainer.min_lr",
        ("trainer.schedule",),
        lambda schedule: schedule in ("constant", "exponential", "multistep", "coda_cosine"),
    ),
    Unused("trainer.label_smoothing", ("trainer.mixup", "trainer.cutmix"), lambda mixup, cutmix: not (mixup or cutmix)),
    Unused("data.crop_padding", ("data.train_crop",), lambda crop: crop != "pad"),
    Unused("data.resized_crop_scale", ("data.train_crop",), lambda crop: crop != "resized"),
    Unused("data.randaugment_magnitude", ("data.randaugment_ops",), lambda ops: ops == 0),
    Unused("data.val_seed", ("data.val_fraction",), lambda fraction: fraction == 0),
    Unused("data.split_seed", ("data.folder_split",), lambda split: split in ("own", "lists")),
    Unused("data.test_fraction", ("data.folder_split",), lambda split: split in ("own", "lists")),
    Unused("data.permutation_seed", ("data.tasks_by",), lambda tasks_by: tasks_by != "pixel_permutations"),
    Unused("data.permutation_size", ("data.tasks_by",), lambda tasks_by: tasks_by != "pixel_permutations"),
    Unused("backbone.refiner_expand", ("backbone.refiner",), lambda refiner: not refiner),
    Unused("backbone.refiner_kernel", ("backbone.refiner",), lambda refiner: not refiner),
]


def overridden_keys(overrides: list[str]) -> set[str]:
    """The keys a command line (or a sweep job) sets: ``trainer.lr=0.1`` and ``+method.x=1`` -> trainer.lr, method.x."""
    return {o.split("=", 1)[0].lstrip("+~") for o in overrides if "=" in o}


def inert_settings(cfg: RunConfig, overridden: set[str], method_inert: dict[str, str]) -> list[str]:
    """A warning for each setting that makes the run's training, or a key set on its command line, do nothing:
    a warm-up that covers every epoch of a task, and each overridden key that another setting makes unused
    (``method_inert``: the method's own, from :meth:`clbench.methods.Method.unused_keys`)."""
    trainer, lines = cfg.trainer, []
    if 0 < trainer.epochs <= trainer.warmup_epochs:
        reached = trainer.epochs / trainer.warmup_epochs
        lines.append(
            f"trainer.warmup_epochs={trainer.warmup_epochs:g} covers every one of a task's trainer.epochs="
            f"{trainer.epochs} epochs: the learning rate ends its linear warm-up at {reached:.0%} of trainer.lr and "
            f"trainer.schedule={trainer.schedule} never starts. Hyperparameters that act through training may then "
            "change little or nothing; lower trainer.warmup_epochs or raise trainer.epochs."
        )
    unused = {u.key: why for u in UNUSED if (why := u.why(cfg)) is not None} | method_inert
    lines += [f"{key} is set but changes nothing with {why}." for key, why in unused.items() if key in overridden]
    return lines
