"""The on-disk cache of ``data.store=stream|auto``: each source decoded once, at the benchmark's storage resolution,
into uint8 ``.npy`` arrays that the training processes memory-map.

A source's cache is the folder ``<data.cache_dir>/<source>-<key>``: ``{train,test}_{x,y}.npy`` and ``meta.json`` (its
class names, seeded split and the key's inputs). The key hashes the cache format, the data options that change what
is stored (``store_size``, the seeded split, the synthetic source's shape) and the source's file list: every file under
its folder with its size and modification time. A changed source therefore gets a new folder, built anew. Building
holds a file lock (filelock), so two jobs that start together build it once; the arrays are written chunk by chunk
into a temporary folder renamed into place when complete, so a killed build leaves nothing that looks finished.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
from filelock import FileLock, Timeout

from clbench.config import DataConfig
from clbench.data.decoding import LazyImages
from clbench.data.sources import SourceData, source_folder
from clbench.data.stream import DiskImages
from clbench.errors import DataError
from clbench.files import write_atomic

FORMAT = 1  # bump when what a cache holds changes
SYNTHETIC = tuple(k for k in DataConfig.__dataclass_fields__ if k.startswith("synthetic_"))  # what it generates
READ = ("store_size", "test_fraction", "split_seed")  # a read source: its resolution and a folder's seeded split
ARRAYS = ("train_x", "train_y", "test_x", "test_y")


def cache_root(cfg: DataConfig) -> Path:
    return Path(cfg.cache_dir if cfg.cache_dir else Path(cfg.root) / "clbench-cache").expanduser()


def file_list_digest(folder: Path | None) -> str:
    """SHA-256 of every file under ``folder`` (relative path, size, mtime in ns), in sorted order; '' without one."""
    if folder is None or not folder.exists():
        return ""
    entries = []
    for dirpath, _dirs, files in os.walk(folder):
        for name in files:
            path = Path(dirpath) / name
            stat = path.stat()
            entries.append(f"{path.relative_to(folder)}\t{stat.st_size}\t{stat.st_mtime_ns}")
    return hashlib.sha256("\n".join(sorted(entries)).encode()).hexdigest()


def cache_key(name: str, cfg: DataConfig, rgb_size: int | None) -> dict[str, Any]:
    """What the cached arrays depend on; its hash names the cache folder."""
    options = asdict(cfg)
    return {
        "format": FORMAT,
        "source": name,
        "rgb_size": rgb_size,
        "options": {k: options[k] for k in (SYNTHETIC if name == "synthetic" else READ)},
        "files": file_list_digest(source_folder(name, cfg)),
    }


def cached_source(
    name: str, cfg: DataConfig, load: Callable[[], SourceData], rgb_size: int | None, say: Callable[[str], None]
) -> SourceData:
    """Source ``name`` with its images on disk (:class:`DiskImages`): from its cache, or ``load()``-ed, converted to
    RGB at ``rgb_size`` where given (the datasets of a sequence), and written to the cache first."""
    key = cache_key(name, cfg, rgb_size)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    root = cache_root(cfg)
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise DataError(
            f"Cannot create the image cache {root} ({err.strerror}). Point data.cache_dir at a writable folder "
            "(node-local scratch is fastest), or use data.store=device."
        ) from None
    folder = root / f"{name}-{digest}"
    lock = FileLock(root / f"{folder.name}.lock")
    try:
        lock.acquire(timeout=0)
    except Timeout:
        say(f"clbench: waiting for another job to finish building the image cache {folder}")
        lock.acquire()
    try:
        if not (folder / "meta.json").is_file():
            build(folder, key, load, rgb_size, say)
        return open_cache(folder, cfg.stream_workers)
    finally:
        lock.release()


def build(
    folder: Path, key: dict[str, Any], load: Callable[[], SourceData], rgb_size: int | None, say: Callable[[str], None]
) -> None:
    """Decode the source into ``folder`` (called with the cache's lock held)."""
    partial = folder.with_name(f"{folder.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)  # what a killed build left
    partial.mkdir()
    started = time.time()
    say(f"clbench: decoding {key['source']} once into the image cache {folder}")
    source = load()
    source = source.as_rgb(rgb_size) if rgb_size else source
    try:
        for array, values in zip(ARRAYS, (source.train_x, source.train_y, source.test_x, source.test_y), strict=True):
            write_array(partial / f"{array}.npy", values)
        meta = {"key": key, "class_names": source.class_names, "split": source.split}
        write_atomic(partial / "meta.json", json.dumps(meta, indent=1))
        partial.rename(folder)
    except OSError as err:
        shutil.rmtree(partial, ignore_errors=True)
        if err.errno in (errno.ENOSPC, errno.EDQUOT):
            raise DataError(
                f"No space left to build the image cache {folder} ({err.strerror}). Free space, point data.cache_dir "
                "elsewhere, or use data.store=device."
            ) from None
        raise
    size = sum(f.stat().st_size for f in folder.iterdir()) / 2**30
    say(f"clbench: image cache {folder} built ({size:.2f} GiB in {time.time() - started:.0f} s)")


def write_array(path: Path, values: torch.Tensor | LazyImages) -> None:
    """``values`` as a ``.npy`` file, lazy images decoded and written a chunk at a time."""
    out = np.lib.format.open_memmap(
        path, mode="w+", dtype=np.uint8 if len(values.shape) == 4 else np.int64, shape=tuple(values.shape)
    )
    if isinstance(values, LazyImages):
        for lo, chunk in values.chunks():
            out[lo : lo + len(chunk)] = chunk.numpy()
    else:
        out[:] = values.numpy()
    out.flush()
    del out


def open_cache(folder: Path, workers: int) -> SourceData:
    """A built cache as :class:`SourceData` whose images stay on disk."""
    try:
        meta = json.loads((folder / "meta.json").read_text())
        arrays = {a: np.load(folder / f"{a}.npy", mmap_mode="r") for a in ARRAYS}
    except (OSError, ValueError) as err:
        raise DataError(
            f"The image cache {folder} is damaged ({type(err).__name__}: {err}). Delete that folder: the next run "
            "builds it again."
        ) from None
    images = [DiskImages.whole(folder / f"{a}.npy", arrays[a].shape, workers) for a in ("train_x", "test_x")]
    labels = [torch.from_numpy(np.array(arrays[a])) for a in ("train_y", "test_y")]
    return SourceData(images[0], labels[0], images[1], labels[1], meta["class_names"], meta["split"])
