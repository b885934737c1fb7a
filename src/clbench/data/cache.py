"""The on-disk cache of ``data.store=stream|auto``: each source decoded once, at the benchmark's storage resolution,
into uint8 ``.npy`` arrays that the training processes memory-map.

A source's cache is the folder ``<data.cache_dir>/<source>-<key>``: ``{train,test}_{x,y}.npy`` and ``meta.json`` (its
class names, seeded split, array shapes, the arrays' checksums and the key's inputs). The key hashes the cache format,
the data options that change what is stored (``store_size``, the seeded split, the synthetic source's shape), the
decoders' versions and the source's file list: every folder and file under its folder (symbolic links followed) with
the files' sizes, modification times and status-change times (``ctime``: set by every write, and not by ``os.utime``,
so a file rewritten in place and given back its old mtime still changes the key). The files' contents are not hashed
(a dataset of a million images would be read at every start). A changed source therefore gets a new folder, built
anew. Opening a cache checks its arrays against the checksums of the build (:mod:`clbench.data.checksums`), its
labels against its classes and its metadata for completeness. Building holds a file lock (filelock),
so two jobs that start together build it once; each builder writes into a folder of its own, checked for free space
first, and renames it into place when complete, so a killed build leaves nothing that looks finished.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import PIL
import torch
import torchvision
from filelock import FileLock, Timeout

from clbench.config import DataConfig
from clbench.data import checksums
from clbench.data.decoding import LazyImages
from clbench.data.sources import SourceData, source_folder
from clbench.data.split_lists import lists_digest
from clbench.data.stream import DiskImages
from clbench.distributed import Ranks
from clbench.errors import DataError
from clbench.files import undone_on_failure, write_atomic

FORMAT = 2  # bump when what a cache holds changes (2: checksums in meta.json, ctimes in the key)
SYNTHETIC = tuple(k for k in DataConfig.__dataclass_fields__ if k.startswith("synthetic_"))  # what it generates
READ = ("store_size", "test_fraction", "split_seed")  # a read source: its resolution and a folder's seeded split
ARRAYS = ("train_x", "train_y", "test_x", "test_y")


def cache_root(cfg: DataConfig) -> Path:
    return Path(cfg.cache_dir if cfg.cache_dir else Path(cfg.root) / "clbench-cache").expanduser()


def file_list_digest(folder: Path | None) -> str:
    """SHA-256 of every folder and file under ``folder`` (relative path; a file's size, mtime and ctime in ns), in
    sorted order, following symbolic links as the readers do (``<root>/imagenet/train -> /shared/...``); '' without
    one. Folders count because an empty class folder is a class (it shifts the labels after it)."""
    if folder is None or not folder.exists():
        return ""
    entries = []
    for dirpath, dirs, files in os.walk(folder, followlinks=True):
        base = Path(dirpath)
        entries += [f"{(base / d).relative_to(folder)}/" for d in dirs]
        for name in files:
            stat = (base / name).stat()
            times = f"{stat.st_mtime_ns}\t{stat.st_ctime_ns}"
            entries.append(f"{(base / name).relative_to(folder)}\t{stat.st_size}\t{times}")
    return hashlib.sha256("\n".join(sorted(entries)).encode()).hexdigest()


def cache_key(name: str, cfg: DataConfig, rgb_size: int | None) -> dict[str, Any]:
    """What the cached arrays depend on; its hash names the cache folder. The decoders' versions count: a Pillow or
    torchvision that resizes differently must not be mixed with pixels an older one stored."""
    options = asdict(cfg)
    return {
        "format": FORMAT,
        "source": name,
        "rgb_size": rgb_size,
        "options": {k: options[k] for k in (SYNTHETIC if name == "synthetic" else READ)},
        **({"split_lists": lists_digest(cfg.split_lists)} if cfg.split_lists else {}),  # which images are test images
        **({"square": "short_side"} if cfg.transforms == "pilot" else {}),  # how an image file's square is cut
        "files": file_list_digest(source_folder(name, cfg)),
        "decoders": {"pillow": PIL.__version__, "torchvision": torchvision.__version__, "numpy": np.__version__},
    }


def cached_source(
    name: str,
    cfg: DataConfig,
    load: Callable[[], SourceData],
    rgb_size: int | None,
    *,
    say: Callable[[str], None],
    ranks: Ranks = Ranks(),  # noqa: B008 (frozen dataclass: the single process)
) -> SourceData:
    """Source ``name`` with its images on disk (:class:`DiskImages`): from its cache, or ``load()``-ed, converted to
    RGB at ``rgb_size`` where given (the datasets of a sequence), and written to the cache first. In a multi-process
    run only rank 0 lists the source's files; the others receive the key. A complete cache is opened without the
    lock, so a read-only shared cache works."""
    source = None
    folder_expected = source_folder(name, cfg)
    if cfg.download and folder_expected is not None and not folder_expected.exists():
        source = load()  # downloads it: the key must see the downloaded files
    key = ranks.broadcast(cache_key(name, cfg, rgb_size) if ranks.is_main else None)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    root = cache_root(cfg)
    folder = root / f"{name}-{digest}"
    if (folder / "meta.json").is_file():
        return open_cache(folder, cfg, ranks)
    try:
        root.mkdir(parents=True, exist_ok=True)
        lock = FileLock(root / f"{folder.name}.lock")
        try:
            lock.acquire(timeout=0)
        except Timeout:
            say(f"clbench: waiting for another job to finish building the image cache {folder}")
            lock.acquire()
    except OSError as err:
        raise DataError(
            f"Cannot write the image cache {root} ({err.strerror}). Point data.cache_dir at a writable folder "
            "(node-local scratch is fastest), or use data.store=device."
        ) from None
    try:
        if not (folder / "meta.json").is_file():
            build(folder, key, source or load(), rgb_size, say, threads=cfg.decode_workers)
    finally:
        lock.release()
    return open_cache(folder, cfg, ranks)  # after the lock: its checks are collective over the ranks


def build(
    folder: Path,
    key: dict[str, Any],
    source: SourceData,
    rgb_size: int | None,
    say: Callable[[str], None],
    *,
    threads: int = 1,
) -> None:
    """Decode ``source`` into ``folder`` (called with the cache's lock held). The arrays are written into a folder of
    this builder's own, renamed into place when complete: where the lock does not hold (a file system without
    working locks), two builders never write into one folder, and the second to finish keeps the first's."""
    for stale in folder.parent.glob(f"{folder.name}.partial-*"):
        shutil.rmtree(stale, ignore_errors=True)  # what killed builds left (the lock is held)
    shutil.rmtree(folder, ignore_errors=True)  # an incomplete folder without meta.json (an interrupted removal)
    source = source.as_rgb(rgb_size) if rgb_size else source
    arrays = dict(zip(ARRAYS, (source.train_x, source.train_y, source.test_x, source.test_y), strict=True))
    need = sum(array_bytes(values) for values in arrays.values())
    free = shutil.disk_usage(folder.parent).free
    if need > free:
        raise DataError(
            f"The image cache for {key['source']} needs {need / 2**30:.1f} GiB, but {folder.parent} has "
            f"{free / 2**30:.1f} GiB free. Free space, point data.cache_dir elsewhere or lower data.store_size."
        )
    partial = folder.with_name(f"{folder.name}.partial-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    partial.mkdir()
    started = time.time()
    say(
        f"clbench: decoding {key['source']} once into the image cache {folder} ({need / 2**30:.2f} GiB; it is used "
        "again while the source's file list, sizes and modification/status-change times stay the same)"
    )
    no_space = (
        f"No space left to build the image cache {folder} ({{}}). Free space, point data.cache_dir elsewhere, or use "
        "data.store=device."
    ).format
    with undone_on_failure(lambda: shutil.rmtree(partial, ignore_errors=True), no_space):
        files = [partial / f"{array}.npy" for array in arrays]
        for path, values in zip(files, arrays.values(), strict=True):
            write_array(path, values)
        shapes = {array: list(values.shape) for array, values in arrays.items()}
        meta = {"key": key, "shapes": shapes, "class_names": source.class_names, "split": source.split}
        meta["sha256"] = {"chunk_bytes": checksums.CHUNK, **checksums.digests(files, threads)}
        write_atomic(partial / "meta.json", json.dumps(meta, indent=1))
        checksums.stamp(partial, files)  # a rename of the folder leaves its files' ctimes as they are
        try:
            partial.rename(folder)
        except OSError as err:
            if err.errno not in (errno.EEXIST, errno.ENOTEMPTY) or not (folder / "meta.json").is_file():
                raise
            shutil.rmtree(partial, ignore_errors=True)  # another builder finished first: keep its folder
    say(f"clbench: image cache {folder} built in {time.time() - started:.0f} s")


def array_bytes(values: torch.Tensor | LazyImages) -> int:
    dtype_size = 1 if len(values.shape) == 4 else 8  # uint8 images, int64 labels
    return int(np.prod(values.shape)) * dtype_size


def write_array(path: Path, values: torch.Tensor | LazyImages) -> None:
    """``values`` as a ``.npy`` file, its space reserved first (a full disk is an error here, not a SIGBUS while a
    memory-mapped page is written), lazy images decoded and written a chunk at a time."""
    dtype = np.uint8 if len(values.shape) == 4 else np.int64
    out = np.lib.format.open_memmap(path, mode="w+", dtype=dtype, shape=tuple(values.shape))
    if hasattr(os, "posix_fallocate"):
        with path.open("r+b") as f:
            os.posix_fallocate(f.fileno(), 0, path.stat().st_size)
    if isinstance(values, LazyImages):
        for lo, chunk in values.chunks():
            out[lo : lo + len(chunk)] = chunk.numpy()
    else:
        out[:] = values.numpy()
    out.flush()
    del out


META = ("key", "shapes", "class_names", "split", "sha256")


def open_cache(folder: Path, cfg: DataConfig, ranks: Ranks = Ranks()) -> SourceData:  # noqa: B008
    """A built cache as :class:`SourceData` whose images stay on disk. Refused as damaged: metadata that is not
    complete, arrays whose shapes or types differ from what the build recorded (a truncated or replaced file), labels
    outside the cache's classes and, with ``data.verify_checksums``, array files whose checksums differ from the
    build's (checked by rank 0 for every rank)."""
    try:
        meta = json.loads((folder / "meta.json").read_text())
        missing = [k for k in META if k not in meta]
        if missing:
            raise ValueError(f"meta.json has no {', '.join(missing)}")
        arrays = {a: np.load(folder / f"{a}.npy", mmap_mode="r") for a in ARRAYS}
        wrong = [a for a in ARRAYS if list(arrays[a].shape) != meta["shapes"][a]]
        wrong += [a for a in ARRAYS if arrays[a].dtype != (np.uint8 if a.endswith("_x") else np.int64)]
        if wrong:
            raise ValueError(f"{', '.join(sorted(set(wrong)))} not of the recorded shape and type")
        labels = {a: torch.from_numpy(np.array(arrays[a])) for a in ("train_y", "test_y")}
        classes = len(meta["class_names"])
        outside = [a for a, y in labels.items() if len(y) and not (int(y.min()) >= 0 and int(y.max()) < classes)]
        if outside:
            raise ValueError(f"{', '.join(outside)} hold labels outside the {classes} classes")
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise DataError(
            f"The image cache {folder} is damaged ({type(err).__name__}: {err}). Delete that folder: the next run "
            "builds it again."
        ) from None
    if cfg.verify_checksums:
        files = [folder / f"{a}.npy" for a in ARRAYS]
        failure = None
        if ranks.is_main:
            try:
                checksums.verify(folder, files, meta["sha256"], cfg.decode_workers)
            except DataError as err:
                failure = str(err)
        failure = ranks.broadcast(failure)
        if failure is not None:
            raise DataError(failure)
    images = [DiskImages.whole(folder / f"{a}.npy", arrays[a].shape, cfg.stream_workers) for a in ("train_x", "test_x")]
    return SourceData(images[0], labels["train_y"], images[1], labels["test_y"], meta["class_names"], meta["split"])
