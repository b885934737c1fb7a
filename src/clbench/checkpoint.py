"""Checkpoints: what a run needs to go on exactly where it stopped (``clbench ... resume=true``).

``<run_dir>/checkpoint.pt`` holds the method's state (backbone, heads, masks, pools, gates, owners), the
optimizer and schedule of the phase in progress, every RNG state (Python, NumPy, torch, CUDA), the position in
the task / phase / epoch / batch order with the epoch's permutation, the results so far and the W&B run id. It is
written atomically (temporary file + rename) at the end of every task, every ``trainer.checkpoint_every``
epochs and on SIGTERM/SIGINT, replacing the previous one; it is read with ``torch.load(weights_only=True)``.

It carries its own integrity record, written in the same file (so atomically with it): the SHA-256 of each of its
values (:mod:`clbench.state_digest`). A resume recomputes them before any work and refuses a checkpoint in which any
value differs from what was written (a flipped byte on disk, an edit), naming the file and the values.
"""

from __future__ import annotations

import io
import pickle
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from clbench.errors import DataError
from clbench.files import write_atomic
from clbench.state_digest import digests, mismatches

FILE = "checkpoint.pt"
VERSION = 2  # 2: with an integrity record


@dataclass
class Cursor:
    """Where training stands inside a task: ``batch`` batches of ``epoch`` of ``phase`` are done."""

    phase: int = 0
    epoch: int = 0
    batch: int = 0
    order: torch.Tensor | None = None  # the permutation of the epoch in progress (None: draw a new one)
    optimizer: dict[str, Any] | None = None
    schedule: dict[str, Any] | None = None
    plateau: dict[str, Any] | None = None  # trainer.schedule=plateau: the schedule's state and best weights
    diagnostics: dict[str, Any] | None = None  # the method's logged values summed over the phase's steps so far


@dataclass
class Position:
    """``task`` is being trained (``cursor`` set) or is the next to start (``cursor`` None)."""

    task: int
    step: int
    cursor: Cursor | None = field(default=None)


def rng_state() -> dict[str, Any]:
    version, state, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "python": [version, list(state), gauss],
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached],
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def restore_rng(state: dict[str, Any]) -> None:
    version, values, gauss = state["python"]
    random.setstate((version, tuple(values), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if state["cuda"]:
        torch.cuda.set_rng_state_all(state["cuda"])


def save(run_dir: Path, position: Position, payload: dict[str, Any]) -> None:
    cursor = asdict(position.cursor) if position.cursor else None
    state = {"version": VERSION, "position": {**asdict(position), "cursor": cursor}, "rng": rng_state(), **payload}
    state["integrity"] = digests(state)
    buf = io.BytesIO()
    torch.save(state, buf)
    write_atomic(run_dir / FILE, buf.getvalue())


def load(run_dir: Path) -> tuple[Position, dict[str, Any]]:
    """The checkpoint of ``run_dir``; a missing, truncated or foreign file is a :class:`DataError` naming it."""
    path = run_dir / FILE
    if not path.is_file():
        raise DataError(
            f"Cannot resume: {path} does not exist (the run wrote no checkpoint, or this is not its folder)."
        )
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except (RuntimeError, pickle.UnpicklingError, EOFError, ValueError, OSError) as err:
        raise DataError(f"Cannot resume: {path} is corrupt or truncated ({type(err).__name__}: {err}).") from None
    if not isinstance(state, dict) or state.get("version") != VERSION:
        raise DataError(
            f"Cannot resume: {path} is not a clbench checkpoint of version {VERSION} (a checkpoint with an integrity "
            "record); one written by an older clbench resumes with that clbench."
        )
    record = state.pop("integrity", None)
    if not isinstance(record, dict):
        raise DataError(f"Cannot resume: {path} has no integrity record, so what it holds cannot be verified.")
    wrong = mismatches(record, state)
    if wrong:
        shown = "; ".join(wrong[:8]) + (f"; and {len(wrong) - 8} more" if len(wrong) > 8 else "")
        raise DataError(
            f"Cannot resume: {path} does not match what was written (its integrity record): {shown}. It was damaged "
            "or edited since; resume from an intact copy, or start the run again in another folder. The folder is "
            "left as it was."
        )
    pos = state["position"]
    cursor = Cursor(**pos["cursor"]) if pos["cursor"] else None
    return Position(pos["task"], pos["step"], cursor), state
