"""Checksums of the image cache's arrays: the SHA-256 of every 64 MiB chunk of every ``.npy`` file, recorded in
``meta.json`` when the cache is built and checked when it is opened (``data.verify_checksums``, on by default), so an
array damaged or replaced in place is refused instead of trained on.

Hashing a large cache takes a while (about a second a GB a thread), so a successful check leaves a stamp,
``verified.json``: each file's size, modification and status-change times and inode. A file whose stamp still
matches is not hashed again; any write to it changes its status-change time (``ctime``, which no user call can set
back), so every change made through the file system is hashed again. What the stamp cannot see is decay of the disk
under an unchanged file; deleting ``verified.json`` checks everything again.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from clbench.errors import DataError
from clbench.files import write_atomic

CHUNK = 64 << 20
STAMP = "verified.json"


def chunk_digest(path: Path, index: int) -> str:
    with path.open("rb") as f:
        return hashlib.sha256(os.pread(f.fileno(), CHUNK, index * CHUNK)).hexdigest()


def digests(paths: list[Path], threads: int) -> dict[str, list[str]]:
    """Every file's chunk digests (by file name), hashed by ``threads`` threads (hashlib releases the GIL)."""
    jobs = [(p, i) for p in paths for i in range(max(1, -(-p.stat().st_size // CHUNK)))]
    with ThreadPoolExecutor(max(1, threads)) as pool:
        done = list(pool.map(lambda job: chunk_digest(*job), jobs))
    out: dict[str, list[str]] = {p.name: [] for p in paths}
    for (path, _), digest in zip(jobs, done, strict=True):
        out[path.name].append(digest)
    return out


def signature(path: Path) -> list[int]:
    """What changes whenever a file is written: size, mtime and ctime (ns), inode."""
    stat = path.stat()
    return [stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino]


def stamp(folder: Path, paths: list[Path]) -> None:
    """Record the files as checked; a cache folder that cannot be written (read-only, shared) is checked each time."""
    with contextlib.suppress(OSError):
        write_atomic(folder / STAMP, json.dumps({p.name: signature(p) for p in paths}))


def verify(folder: Path, paths: list[Path], recorded: dict[str, Any], threads: int) -> None:
    """Refuse a file whose chunk digests differ from ``recorded`` (those of the build), naming it and the first bytes
    that differ; files whose stamp still matches are trusted."""
    try:
        stamped = json.loads((folder / STAMP).read_text())
    except (OSError, ValueError):
        stamped = {}
    changed = [p for p in paths if stamped.get(p.name) != signature(p)]
    if not changed:
        return
    for name, found in digests(changed, threads).items():
        expected = recorded.get(name)
        if found != expected:
            chunk = next((i for i, (a, b) in enumerate(zip(found, expected or [], strict=False)) if a != b), None)
            where = f"the SHA-256 of its bytes from {chunk * CHUNK} on" if chunk is not None else "its length"
            raise DataError(
                f"The image cache {folder} is damaged: {name} is not what was stored when it was built ({where} "
                "differs). Delete that folder: the next run builds it again."
            )
    stamp(folder, paths)
