"""SHA-256 digests of nested state (a checkpoint's dicts, lists, tensors and numbers), one per leaf and named by its
path (``method/memory.images``), so that a resume can say which value no longer matches what was written.

A tensor's digest covers its dtype, shape and bytes (hashed in 64 MiB chunks on a thread pool: hashlib releases the
GIL, so a large checkpoint is hashed on every core); any other leaf's covers its type and ``repr`` (a list of plain
numbers, such as Python's RNG state, is one leaf).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

CHUNK = 64 * 2**20


def leaves(state: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """Every leaf of ``state`` with its path: dict keys joined by ``/``, list positions as ``[i]``."""
    if isinstance(state, dict):
        for key, value in state.items():
            yield from leaves(value, f"{path}/{key}" if path else str(key))
    elif isinstance(state, list | tuple) and any(isinstance(v, dict | list | tuple | torch.Tensor) for v in state):
        for i, value in enumerate(state):
            yield from leaves(value, f"{path}[{i}]")
    else:
        yield path, state


def tensor_bytes(tensor: torch.Tensor) -> np.ndarray:
    """The tensor's bytes as a flat uint8 array on the host (a view where it is already a contiguous host tensor)."""
    return tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()


def digests(state: Any) -> dict[str, str]:
    """Each leaf's SHA-256 (hex, 128 bits), by path."""
    out = {}
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        for path, value in leaves(state):
            digest = hashlib.sha256()
            if isinstance(value, torch.Tensor):
                digest.update(f"tensor {value.dtype} {tuple(value.shape)}".encode())
                data = tensor_bytes(value)
                chunks = [data[i : i + CHUNK] for i in range(0, max(len(data), 1), CHUNK)]
                for part in pool.map(lambda chunk: hashlib.sha256(chunk).digest(), chunks):
                    digest.update(part)
            else:
                digest.update(f"{type(value).__name__} {value!r}".encode())
            out[path] = digest.hexdigest()[:32]
    return out


def mismatches(recorded: dict[str, str], state: Any) -> list[str]:
    """What of ``state`` differs from the ``recorded`` digests: each changed, missing or added leaf, named."""
    now = digests(state)
    changed = [f"{p} changed" for p in recorded if p in now and now[p] != recorded[p]]
    missing = [f"{p} is missing" for p in recorded if p not in now]
    added = [f"{p} was added" for p in now if p not in recorded]
    return changed + missing + added
