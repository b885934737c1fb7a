"""What every bench entry shares: the entry's parts, the timer, FLOP counting and the GPUs' bf16 peaks."""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

# Dense bf16 tensor-core peaks (vendor datasheets); the first name contained in the device's name wins.
PEAK_BF16_FLOPS = {
    "H100 PCIe": 756e12,
    "H100 NVL": 835e12,
    "H100": 989e12,  # SXM
    "H200": 989e12,
    "GH200": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
}


@dataclass
class Entry:
    """A bench entry's step and what is measured beside it: ``data`` (its data part, timed alone, or the
    :class:`Waits` recorded during the step), ``flops`` (the same step run eagerly, for FLOP counting: a compiled
    step or a graph replay dispatches no countable operator)."""

    step: Callable[[], Any]
    device: torch.device
    data: Callable[[], Any] | Waits | None = None
    flops: Callable[[], Any] | None = None
    images: int | None = None  # images a step trains on, memory images included (None: the batch size)


def peak_flops(device: torch.device, given: float | None = None) -> float | None:
    """``given`` (--peak-flops) if set, else the table's peak for this GPU; None on CPU or an unknown GPU."""
    if given is not None:
        return given
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)


def timed(step: Callable[[], Any], device: torch.device, *, warmup: int, steps: int, repeats: int) -> float:
    """Median seconds per step."""
    for _ in range(warmup):
        step()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    per_step = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        for _ in range(steps):
            step()
        sync()
        per_step.append((time.perf_counter() - start) / steps)
    return statistics.median(per_step)


def step_flops(step: Callable[[], Any]) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        step()
    return counter.get_total_flops()


def compose(overrides: list[str]) -> Any:
    """The run config the CLI would compose from ``overrides``, validated."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from clbench.config import config_dir, validate

    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        return validate(hydra_compose("config", overrides=overrides))


def device_of(args: argparse.Namespace) -> torch.device:
    from clbench.loop.runtime import resolve_device

    return resolve_device(args.device)


def cycle(batches: Callable[[], Iterator[Any]]) -> Callable[[], Any]:
    """A step that returns the next batch, starting a new epoch when one ends."""
    state: dict[str, Iterator[Any]] = {"it": batches()}

    def step() -> Any:
        try:
            return next(state["it"])
        except StopIteration:
            state["it"] = batches()
            return next(state["it"])

    return step


class Waits:
    """Streamed batches for a training step, with the time each ``next()`` waited for its batch."""

    def __init__(self, split: Any, batch_size: int) -> None:
        self.batch = cycle(lambda: split.batches(batch_size, shuffle=True))
        self.seconds: list[float] = []

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        start = time.perf_counter()
        out = self.batch()
        self.seconds.append(time.perf_counter() - start)
        return out

    def mean(self, last: int) -> float:
        """The mean wait of the ``last`` batches (the timed ones, after the warm-up)."""
        return float(np.mean(self.seconds[-last:]))
