"""Images that stay on disk (``data.store=stream``): rows of the cache's memory-mapped ``.npy`` arrays, read batch by
batch by DataLoader worker processes into pinned memory and copied to the device one batch ahead of the step, on a
side CUDA stream. A rank of a multi-process run reads only the rows of each batch it trains on.

The epoch order is drawn exactly as for images held on the device (``torch.randperm`` on the labels' device), and the
device-side augmentation is the same, so both stores give the same numbers.
"""

from __future__ import annotations

import atexit
import multiprocessing
import multiprocessing.context
import signal
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from clbench.errors import DataError

Rows = Callable[[int], np.ndarray | None]  # batch size -> the positions in the batch this process reads (None: all)


@cache
def worker_context() -> multiprocessing.context.BaseContext:
    """How reader workers start: from a fork server (a clean process started once, which imports this module), not
    forked from the training process, whose threads (gloo's, rich's progress refresh, the previous loader's) can hold
    an interpreter lock at the moment of a fork and leave the child waiting on it forever (seen under torchrun). The
    server holds the stop signals (:mod:`clbench.data.reader_server`), so its workers are born with them held."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([__name__, "clbench.data.reader_server"])
    return context


@cache
def _array(path: str) -> np.ndarray:
    """A cache array, memory-mapped once per process (each reader worker maps its own)."""
    try:
        return np.load(path, mmap_mode="r")
    except (OSError, ValueError) as err:
        raise DataError(
            f"The image cache file {path} cannot be read ({getattr(err, 'strerror', None) or err}): it was deleted, "
            f"moved or damaged while the run was using it. Delete what is left of {Path(path).parent} and run the same "
            "command with resume=true: the cache is built again and the run goes on from its last checkpoint."
        ) from None


@dataclass(frozen=True)
class ReadFailure:
    """What a reader worker returns instead of a batch it could not read: the :class:`DataError`'s message, raised
    again in the training process (a worker's exception would arrive wrapped in its traceback)."""

    message: str


_LIVE: weakref.WeakSet = weakref.WeakSet()  # the batch loaders whose workers may be running


def shut_down(iterator: object) -> None:
    """Stop a loader iterator's workers now (they ignore the first SIGTERM, so terminating them at exit would wait)."""
    stop = getattr(iterator, "_shutdown_workers", None)
    if stop is not None:
        stop()
    _LIVE.discard(iterator)


# At exit, before multiprocessing's own exit handler (registered earlier, so run later) joins the workers: a run that
# ends on an exception raised outside a loader (a stop signal, an error in the step) does not wait for them forever.
atexit.register(lambda: [shut_down(iterator) for iterator in list(_LIVE)])


@dataclass(frozen=True, eq=False)
class DiskImages:
    """Images (uint8, C x H x W each) kept in ``.npy`` arrays: image ``i`` is row ``row[i]`` of ``files[part[i]]``.
    Indexes and concatenates like a tensor without reading a pixel; ``device`` is where batches go,
    ``workers`` the DataLoader processes that read them."""

    files: tuple[str, ...]
    part: np.ndarray
    row: np.ndarray
    image_shape: tuple[int, ...]
    workers: int = 0
    device: torch.device = torch.device("cpu")  # noqa: RUF009 (immutable)

    @staticmethod
    def whole(path: Path, shape: tuple[int, ...], workers: int) -> DiskImages:
        n = shape[0]
        return DiskImages((str(path),), np.zeros(n, np.int16), np.arange(n, dtype=np.int64), tuple(shape[1:]), workers)

    def __len__(self) -> int:
        return len(self.row)

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self), *self.image_shape)

    @property
    def nbytes(self) -> int:
        return len(self) * int(np.prod(self.image_shape))

    def __getitem__(self, index: torch.Tensor | np.ndarray | slice) -> DiskImages:
        """The images at ``index`` (a boolean mask, positions or a slice), still on disk."""
        index = index.cpu().numpy() if isinstance(index, torch.Tensor) else index
        return replace(self, part=self.part[index], row=self.row[index])

    def contiguous(self) -> DiskImages:
        return self

    def to(self, device: torch.device, non_blocking: bool = False) -> DiskImages:
        """Batches will be delivered to ``device``; nothing moves now."""
        return replace(self, device=device)

    @staticmethod
    def cat(parts: list[DiskImages]) -> DiskImages:
        files = tuple(dict.fromkeys(f for p in parts for f in p.files))
        part = [np.asarray([files.index(f) for f in p.files], np.int16)[p.part] for p in parts]
        return replace(parts[0], files=files, part=np.concatenate(part), row=np.concatenate([p.row for p in parts]))

    def read(self, positions: np.ndarray) -> torch.Tensor:
        """The images at ``positions`` from disk, in that order (each array's rows read in ascending order)."""
        out = np.empty((len(positions), *self.image_shape), dtype=np.uint8)
        parts, rows = self.part[positions], self.row[positions]
        for p in np.unique(parts):
            where = np.flatnonzero(parts == p)
            ascending = where[np.argsort(rows[where], kind="stable")]
            out[ascending] = _array(self.files[p])[rows[ascending]]
        return torch.from_numpy(out)

    def batches(
        self, order: np.ndarray, batch_size: int, start: int = 0, rows: Rows | None = None
    ) -> Iterator[torch.Tensor]:
        """Batches ``start ..`` of the epoch in ``order`` on ``device``, read ahead by the workers (in this process
        where the epoch has no more batches than workers: a task's few test batches are not worth starting them).
        With ``rows``, only those positions of each batch are read; the others are zero."""
        reader = BatchReader(self, order, batch_size, start, rows)
        workers = self.workers if len(reader) > self.workers else 0
        loader = DataLoader(
            reader,
            batch_size=None,
            num_workers=workers,
            pin_memory=self.device.type == "cuda",
            generator=torch.Generator(),  # DataLoader seeds its workers from this, not from the global generator
            worker_init_fn=ignore_stop_signals,
            multiprocessing_context=worker_context() if workers else None,
        )
        iterator = iter(loader)
        _LIVE.add(iterator)
        try:
            for b, part in enumerate(ahead_on(self.device, raising_failures(iterator)), start):
                n = min(batch_size, len(order) - b * batch_size)
                positions = rows(n) if rows is not None else None
                if positions is None:
                    yield part
                    continue
                full = torch.zeros((n, *self.image_shape), dtype=torch.uint8, device=self.device)
                for (lo, hi), at in runs(positions):  # slices: no index tensor copied to the device, no sync
                    full[lo:hi] = part[at : at + hi - lo]
                yield full
        finally:
            shut_down(iterator)


def raising_failures(batches: Iterable[torch.Tensor | ReadFailure]) -> Iterator[torch.Tensor]:
    """The batches, with a worker's :class:`ReadFailure` raised here as the :class:`DataError` it was."""
    for batch in batches:
        if isinstance(batch, ReadFailure):
            raise DataError(batch.message)
        yield batch


def runs(positions: np.ndarray) -> Iterator[tuple[tuple[int, int], int]]:
    """The ascending ``positions`` as runs of consecutive values: ((first, last + 1), index of first in positions)."""
    breaks = np.flatnonzero(np.diff(positions) != 1) + 1
    for first, end in zip([0, *breaks.tolist()], [*breaks.tolist(), len(positions)], strict=True):
        yield (int(positions[first]), int(positions[end - 1]) + 1), first


STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}


def ignore_stop_signals(_worker: int) -> None:
    """A worker ignores SIGINT and the first SIGTERM, which a terminal or SLURM sends the whole process group: the
    training process writes its checkpoint at the end of the step and then shuts the workers down itself. A second
    SIGTERM (the loader's or multiprocessing's own terminate at shutdown) ends the worker as usual. The worker was born
    with the stop signals held (:mod:`clbench.data.reader_server`): they are let through once these handlers are set,
    and one that arrived before is handled then."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda _signum, _frame: signal.signal(signal.SIGTERM, signal.SIG_DFL))
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


class BatchReader(Dataset):
    """Item ``i``: batch ``start + i`` of the epoch in ``order`` (the positions ``rows`` names, or all of them)."""

    def __init__(self, images: DiskImages, order: np.ndarray, batch_size: int, start: int, rows: Rows | None) -> None:
        self.images, self.order, self.batch_size, self.start, self.rows = images, order, batch_size, start, rows

    def __len__(self) -> int:
        return max(0, -(-len(self.order) // self.batch_size) - self.start)

    def __getitem__(self, i: int) -> torch.Tensor | ReadFailure:
        lo = (self.start + i) * self.batch_size
        batch = self.order[lo : lo + self.batch_size]
        positions = self.rows(len(batch)) if self.rows is not None else None
        try:
            return self.images.read(batch if positions is None else batch[positions])
        except DataError as err:
            return ReadFailure(str(err))


def ahead_on(device: torch.device, batches: Iterable[torch.Tensor]) -> Iterator[torch.Tensor]:
    """``batches`` on ``device``; on CUDA each is copied on a side stream while the step before it runs."""
    if device.type != "cuda":
        yield from (b.to(device) for b in batches)
        return
    side, pending = torch.cuda.Stream(device), None
    for b in batches:
        with torch.cuda.stream(side):
            copied = b.to(device, non_blocking=True)
            done = torch.cuda.Event()
            done.record(side)
        if pending is not None:
            yield pending
        torch.cuda.current_stream(device).wait_event(done)
        copied.record_stream(torch.cuda.current_stream(device))
        pending = copied
    if pending is not None:
        yield pending
