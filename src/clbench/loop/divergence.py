"""Which part of the training loss went non-finite first, for the message of a run stopped by a NaN or Inf loss: a
term that overflows on its own (a distillation at a tiny temperature, a penalty with a huge weight) is named, rather
than the learning rate blamed for it."""

from __future__ import annotations

import math

import torch

from clbench.methods.base import Logs

PARTS = 16  # the loss and up to 15 logged terms are recorded


class FirstNonFinite:
    """The loss and the method's logged terms (``training_loss``'s second value, whose names may change within a phase:
    DER++'s once its memory holds something) at the first step of a phase where one of them was not finite, and that
    step's index in the phase. Device operations on tensors allocated once, written in place (no host sync; they are
    part of a step replayed as a CUDA graph); read when the guard finds the mean loss non-finite."""

    def __init__(self, device: torch.device) -> None:
        self.steps = torch.zeros((), dtype=torch.long, device=device)  # steps taken in the phase
        self.at = torch.full((), -1, dtype=torch.long, device=device)  # the first non-finite step (-1: none yet)
        self.values = torch.zeros(PARTS, device=device)  # the loss and its terms at that step
        self.layout = torch.zeros((), dtype=torch.long, device=device)  # which of ``layouts`` names them
        self.layouts: list[tuple[str, ...]] = []

    def update(self, loss: torch.Tensor, logs: Logs) -> None:
        """Record the step's ``loss`` and ``logs`` if they are the phase's first with a non-finite value."""
        names = ("loss", *logs)[:PARTS]
        if names not in self.layouts:
            self.layouts.append(names)
        parts = [loss, *logs.values()][:PARTS]
        current = torch.stack([v.detach().float().reshape(()) for v in parts])
        first = (self.at < 0) & ~torch.isfinite(current).all()
        self.values[: len(parts)] = torch.where(first, current, self.values[: len(parts)])
        self.at.copy_(torch.where(first, self.steps, self.at))
        self.layout.copy_(torch.where(first, self.layouts.index(names), self.layout))
        self.steps += 1

    def describe(self) -> str:
        """What went non-finite first, and what to change (:func:`blame`); reads the device once the run has stopped."""
        at = int(self.at)
        if at < 0:  # not on this rank
            return "lower trainer.lr or set trainer.grad_clip"
        names = self.layouts[int(self.layout)]
        return blame(dict(zip(names, self.values[: len(names)].tolist(), strict=True)), at)


def blame(values: dict[str, float], at: int) -> str:
    """The message for a phase whose step ``at`` (0-based) was the first with a non-finite ``values["loss"]`` or
    logged term (the other keys). A term non-finite before any update, or while other terms stayed finite, overflowed
    on its own; every term at once after an update may also be weights the update made non-finite; finite terms and a
    non-finite loss point at what combines them."""
    step = f"at the phase's step {at + 1} ({', '.join(f'{k} {v:.4g}' for k, v in values.items())})"
    terms = [k for k in values if k != "loss"]
    bad = [k for k in terms if not math.isfinite(values[k])]
    named = f"{'term' if len(bad) == 1 else 'terms'} {' and '.join(bad)}"
    scale = f"check the method's settings that scale {'it' if len(bad) == 1 else 'them'} (method.*)"
    if bad and at == 0:
        return f"the loss's {named} went non-finite {step}, before any update: {scale}"
    if bad and len(bad) < len(terms):
        return (
            f"the first non-finite value was the loss's {named} {step}, while "
            f"{', '.join(k for k in terms if k not in bad)} stayed finite: {scale}, not the learning rate first"
        )
    if bad:
        return (
            f"the loss and its {named} went non-finite together {step}: either {' and '.join(bad)} overflowed on "
            f"{'its' if len(bad) == 1 else 'their'} own ({scale}), or the update before made the weights non-finite "
            "(lower trainer.lr or set trainer.grad_clip)"
        )
    if terms:
        return (
            f"the loss went non-finite {step} while its logged terms stayed finite: its cross-entropy, or the weights "
            "that combine its terms (method.*), overflowed"
        )
    if at == 0:
        return f"the loss was non-finite {step}, before any update: check the method's settings (method.*)"
    return f"the loss went non-finite {step} after finite ones: lower trainer.lr or set trainer.grad_clip"
