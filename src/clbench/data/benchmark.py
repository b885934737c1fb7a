"""A benchmark is a source's classes, permuted by ``class_order_seed`` and cut into tasks, or a sequence of
datasets with one task each (``source=sequence``: MEAT's six datasets, L2P's 5-datasets).

Labels are remapped so that task ``t`` owns the contiguous global labels ``offset .. offset + n_t - 1`` in
class-order position; results record the original class ids and names of every task.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from clbench.config import DataConfig, require
from clbench.data.archives import check_archive
from clbench.data.cache import cache_root, cached_source
from clbench.data.catalog import dataset_files
from clbench.data.image_folder import seeded_split
from clbench.data.sources import SourceData, load_named_source
from clbench.data.stream import DiskImages, Rows
from clbench.distributed import Ranks
from clbench.errors import ConfigError, DataError


@dataclass(frozen=True)
class Task:
    """One task: its position, its classes (original ids and names) and its global label range."""

    id: int
    classes: tuple[int, ...]
    class_names: tuple[str, ...]
    offset: int

    @property
    def num_classes(self) -> int:
        return len(self.classes)


@dataclass
class Split:
    """Images (uint8, N x C x H x W) and global labels of one task. The images are a tensor on the training device
    (``data.store=device``) or :class:`DiskImages` read from the on-disk cache batch by batch (``stream``); the labels
    are always on the device, so the epoch order is drawn alike for both."""

    x: torch.Tensor | DiskImages
    y: torch.Tensor

    def __len__(self) -> int:
        return len(self.y)

    def to(self, device: torch.device) -> Split:
        return Split(self.x.to(device, non_blocking=True), self.y.to(device, non_blocking=True))

    @staticmethod
    def cat(splits: list[Split]) -> Split:
        if len(splits) == 1:
            return splits[0]
        xs = [s.x for s in splits]
        x = DiskImages.cat(xs) if isinstance(xs[0], DiskImages) else torch.cat(xs)  # type: ignore[arg-type]
        return Split(x, torch.cat([s.y for s in splits]))

    def num_batches(self, batch_size: int, *, drop_last: bool = False) -> int:
        """Batches of ``batch_size`` an epoch: the last partial one counts unless ``drop_last``."""
        return len(self) // batch_size if drop_last else -(-len(self) // batch_size)

    def permutation(self) -> torch.Tensor:
        """A fresh epoch order, drawn on the labels' device."""
        return torch.randperm(len(self), device=self.y.device)

    def _positions(self, order: torch.Tensor | None, index: int, batch_size: int) -> torch.Tensor | slice:
        start = index * batch_size
        return order[start : start + batch_size] if order is not None else slice(start, start + batch_size)

    def batch(self, order: torch.Tensor | None, index: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Batch ``index`` of an epoch in ``order`` (None: the stored order), read at once."""
        idx = self._positions(order, index, batch_size)
        if isinstance(self.x, DiskImages):
            rows = np.arange(*idx.indices(len(self))) if isinstance(idx, slice) else idx.cpu().numpy()
            return self.x.read(rows).to(self.x.device), self.y[idx]
        return self.x[idx], self.y[idx]

    def batches(
        self,
        batch_size: int,
        *,
        shuffle: bool = False,
        order: torch.Tensor | None = None,
        start: int = 0,
        rows: Rows | None = None,
        drop_last: bool = False,
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The batches ``start ..`` of one epoch in ``order`` (``shuffle``: a fresh permutation; neither: the stored
        order), without its last partial batch with ``drop_last``. Images on disk are read ahead by background
        workers, only the ``rows`` of each batch this process uses (the others are zero)."""
        order = self.permutation() if shuffle else order
        batches = self.num_batches(batch_size, drop_last=drop_last)
        if not isinstance(self.x, DiskImages):
            for index in range(start, batches):
                yield self.batch(order, index, batch_size)
            return
        positions = order.cpu().numpy() if order is not None else np.arange(len(self))
        positions = positions[: batches * batch_size]
        for index, x in enumerate(self.x.batches(positions, batch_size, start, rows), start):
            yield x, self.y[self._positions(order, index, batch_size)]


@dataclass
class Benchmark:
    """Ordered tasks with their train, test and (``data.val_fraction`` > 0) validation splits."""

    name: str
    tasks: list[Task]
    train: list[Split]
    test: list[Split]
    splits: list[dict[str, Any]] = field(default_factory=list)  # seeded splits made while loading
    validation: list[Split] = field(default_factory=list)  # held out of train; empty without a validation split

    @property
    def num_classes(self) -> int:
        return sum(t.num_classes for t in self.tasks)

    @property
    def channels(self) -> int:
        return self.train[0].x.shape[1]

    def to(self, device: torch.device) -> Benchmark:
        train, test = [s.to(device) for s in self.train], [s.to(device) for s in self.test]
        return Benchmark(self.name, self.tasks, train, test, self.splits, [s.to(device) for s in self.validation])

    def placed_for(self, device: torch.device, say: Callable[[str], None], ranks: Ranks) -> Benchmark:
        """``data.store=auto``: the images on ``device`` when they take at most half of its free memory (on the CPU,
        shared by the run's processes: half of it over their number), else left in the on-disk cache and streamed;
        rank 0 decides for all and says which and why. Held images are copied a chunk at a time."""
        images = [s.x for s in (*self.train, *self.test) if isinstance(s.x, DiskImages)]
        size, free = sum(x.nbytes for x in images), free_memory(device)
        budget = free / 2 / (ranks.size if device.type == "cpu" else 1)
        fits = ranks.broadcast(size <= budget if ranks.is_main else None)
        if ranks.is_main:
            say(
                f"clbench: data.store=auto: {size / 2**30:.2f} GiB of images, {free / 2**30:.1f} GiB free on {device}: "
                + ("held on the device" if fits else "streamed from the on-disk cache")
            )
        if not fits:
            return self

        def held(split: Split) -> Split:
            if not isinstance(split.x, DiskImages):
                return split
            x = torch.empty(split.x.shape, dtype=torch.uint8, device=device)
            for lo in range(0, len(split), HOLD_CHUNK):
                x[lo : lo + HOLD_CHUNK] = split.x.read(np.arange(lo, min(lo + HOLD_CHUNK, len(split)))).to(device)
            return Split(x, split.y)

        train, test = [held(s) for s in self.train], [held(s) for s in self.test]
        return Benchmark(self.name, self.tasks, train, test, self.splits)

    def hold_out_validation(self, fraction: float, seed: int) -> Benchmark:
        """Move a stratified, seeded ``fraction`` of each class of each task's training data into a validation
        split (at least one image of a class with two or more; :func:`seeded_split`). The split depends on
        ``seed`` only, never on the training seed; its counts are recorded in ``splits``."""
        train, validation, counts = [], [], []
        for task, split in zip(self.tasks, self.train, strict=True):
            held = torch.from_numpy(seeded_split(split.y.numpy(), fraction, seed))
            if not held.any():
                raise ConfigError(
                    f"Invalid value for `data.val_fraction`: {fraction} holds out no image of task {task.id} (each of "
                    f"its classes has at most one training image, which stays for training), so its validation "
                    "metrics would be empty. Allowed here: 0 (no validation split)."
                )
            train.append(Split(split.x[~held], split.y[~held]))
            validation.append(Split(split.x[held], split.y[held]))
            counts.append({"task": task.id, "train_images": len(train[-1]), "validation_images": len(validation[-1])})
        record = {"validation": {"fraction": fraction, "seed": seed, "per_task": counts}}
        return Benchmark(self.name, self.tasks, train, self.test, [*self.splits, record], validation)


def free_memory(device: torch.device) -> int:
    """Bytes free on ``device``: CUDA's free memory, or the host's available memory (Linux's MemAvailable)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        lines = Path("/proc/meminfo").read_text().splitlines()
        meminfo = dict(line.split(":", 1) for line in lines)
        return int(meminfo["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def class_order(num_classes: int, seed: int | None) -> np.ndarray:
    """The class permutation: seeded as iCaRL, PyCIL and PILOT do (``np.random.seed(seed);
    np.random.permutation(num_classes)``: the legacy generator, which a ``RandomState(seed)`` of its own reproduces
    without touching NumPy's global state); the identity for ``seed=None``."""
    if seed is None:
        return np.arange(num_classes)
    return np.random.RandomState(seed).permutation(num_classes)


def pilot_increments(num_classes: int, init_classes: int, increment: int) -> list[int]:
    """PILOT's task sizes (``DataManager.__init__``): ``init_classes``, then ``increment`` while the classes so far
    plus one more increment stay below ``num_classes``, then what remains as a last task."""
    if init_classes > num_classes:
        raise ConfigError(
            f"Invalid value for `data.init_classes`: {init_classes}. Allowed: at most {num_classes} (the classes of "
            "the benchmark)."
        )
    sizes = [init_classes]
    while sum(sizes) + increment < num_classes:
        sizes.append(increment)
    rest = num_classes - sum(sizes)
    return sizes + ([rest] if rest > 0 else [])


def task_chunks(order: np.ndarray, cfg: DataConfig, source_name: str) -> list[np.ndarray]:
    """The class order cut into tasks: PILOT's rule with ``data.increment``, else ``data.tasks`` near-equal parts;
    the task count must be ``data.tasks`` either way."""
    num_classes = len(order)
    if cfg.increment is None:
        require(
            cfg.tasks <= num_classes, "data.tasks", cfg.tasks, f"at most {num_classes} (the classes of {source_name})"
        )
        return np.array_split(order, cfg.tasks)
    assert cfg.init_classes is not None  # set together (DataConfig)
    sizes = pilot_increments(num_classes, cfg.init_classes, cfg.increment)
    require(
        len(sizes) == cfg.tasks,
        "data.tasks",
        cfg.tasks,
        f"{len(sizes)}: the tasks that init_classes={cfg.init_classes}, increment={cfg.increment} make of the "
        f"{num_classes} classes of {source_name} ({', '.join(map(str, sizes))} classes)",
    )
    return np.split(order, np.cumsum(sizes)[:-1])


def split_into_tasks(source: SourceData, cfg: DataConfig) -> Benchmark:
    """Permute the classes, cut them into tasks (:func:`task_chunks`) and keep the first ``num_tasks``."""
    num_classes = len(source.class_names)
    order = class_order(num_classes, cfg.class_order_seed)
    chunks = task_chunks(order, cfg, cfg.folder if cfg.source == "image_folder" else cfg.source)
    position = np.empty(num_classes, dtype=np.int64)
    position[order] = np.arange(num_classes)  # original label -> global label
    remap = torch.from_numpy(position)
    train_y, test_y = remap[source.train_y], remap[source.test_y]

    tasks, train, test, offset = [], [], [], 0
    for task_id, chunk in enumerate(chunks[: cfg.num_tasks or cfg.tasks]):
        names = tuple(source.class_names[c] for c in chunk)
        tasks.append(Task(task_id, tuple(int(c) for c in chunk), names, offset))
        lo, hi = offset, offset + len(chunk)
        tr = (train_y >= lo) & (train_y < hi)
        te = (test_y >= lo) & (test_y < hi)
        train.append(Split(source.train_x[tr].contiguous(), train_y[tr]))
        test.append(Split(source.test_x[te].contiguous(), test_y[te]))
        offset = hi
    return Benchmark(cfg.name, tasks, train, test, [source.split] if source.split else [])


def resized(x: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """uint8 images (N, C, H, W) resized to ``size``."""
    out = F.interpolate(x.float(), size=size, mode="bilinear", antialias=True, align_corners=False)
    return out.round().clamp(0, 255).to(torch.uint8)


def permuted_tasks(source: SourceData, cfg: DataConfig) -> Benchmark:
    """``data.tasks_by=pixel_permutations`` (PermutedMNIST, as SupSup's GN experiments): task t holds every class of
    the source, its images' pixels shuffled by task t's own fixed permutation, drawn by
    np.random.RandomState(permutation_seed + t).permutation(H * W) (the same for every channel), and its labels
    t * classes + class (task-incremental heads of the source's classes). With ``permutation_size`` the images are
    first resized (bilinear, antialiased) to that side, so the permutation moves pixels, not whole patches."""
    classes = len(source.class_names)
    if cfg.permutation_size is not None:
        size = (cfg.permutation_size, cfg.permutation_size)
        source = dataclasses.replace(source, train_x=resized(source.train_x, size), test_x=resized(source.test_x, size))
    h, w = source.train_x.shape[-2:]
    count, per_task, free = cfg.num_tasks or cfg.tasks, source.train_x.nbytes + source.test_x.nbytes, free_memory(CPU)
    require(  # refused before a task is made: the copies would exhaust the host's memory
        count * per_task <= free / 2,
        "data.num_tasks" if cfg.num_tasks else "data.tasks",
        count,
        f"at most {int(free / 2 // per_task)} tasks here: each holds its own permuted copy of the "
        f"{per_task / 2**20:.1f} MiB of {cfg.source} images ({h}x{w} px), {count * per_task / 2**30:.1f} GiB for "
        f"{count}, more than half of the {free / 2**30:.1f} GiB of memory available",
    )
    tasks, train, test = [], [], []
    for t in range(count):
        perm = torch.from_numpy(np.random.RandomState(cfg.permutation_seed + t).permutation(h * w))

        def shuffled(x: torch.Tensor, perm: torch.Tensor = perm) -> torch.Tensor:
            return x.flatten(2)[:, :, perm].reshape(x.shape).contiguous()

        names = tuple(f"permutation {t}/{name}" for name in source.class_names)
        tasks.append(Task(t, tuple(range(classes)), names, t * classes))
        train.append(Split(shuffled(source.train_x), source.train_y + t * classes))
        test.append(Split(shuffled(source.test_x), source.test_y + t * classes))
    record = {"pixel_permutations": {"seed": cfg.permutation_seed, "tasks": len(tasks), "pixels": h * w, "side": h}}
    return Benchmark(cfg.name, tasks, train, test, [*([source.split] if source.split else []), record])


CPU = torch.device("cpu")
HOLD_CHUNK = 4096  # images copied at a time from the cache to the device (store=auto)
Load = Callable[[str, int | None], SourceData]  # (source name, RGB size or None) -> its data, as the store wants it


def sequence_of_datasets(cfg: DataConfig, load: Load) -> Benchmark:
    """One task per dataset of ``cfg.datasets`` (all of its classes, its own train/test split), in that order;
    every dataset stored RGB at ``store_size``. Only the first ``num_tasks`` datasets are loaded."""
    assert cfg.store_size is not None  # checked by DataConfig
    tasks, train, test, splits, offset = [], [], [], [], 0
    for task_id, name in enumerate(cfg.datasets[: cfg.num_tasks or cfg.tasks]):
        source = load(name, cfg.store_size)
        n = len(source.class_names)
        tasks.append(Task(task_id, tuple(range(n)), tuple(f"{name}/{c}" for c in source.class_names), offset))
        train.append(Split(source.train_x, source.train_y + offset))
        test.append(Split(source.test_x, source.test_y + offset))
        splits += [source.split] if source.split else []
        offset += n
    return Benchmark(cfg.name, tasks, train, test, splits)


def check_archives(cfg: DataConfig, ranks: Ranks) -> None:
    """The MD5 of every split archive the benchmark's data came from, where the archive lies in ``data.root``
    (:mod:`clbench.data.archives`); rank 0 checks, every rank stops on a mismatch."""
    names = cfg.datasets if cfg.source == "sequence" else [cfg.folder if cfg.source == "image_folder" else cfg.source]
    for name in dict.fromkeys(names):
        files = dataset_files(str(name), cfg.protocol)
        problem = ranks.broadcast(check_archive(files, cfg, cache_root(cfg)) if ranks.is_main else None)
        if problem:
            raise DataError(problem)


def build_benchmark(
    cfg: DataConfig,
    device: torch.device = CPU,
    say: Callable[[str], None] = print,
    ranks: Ranks = Ranks(),  # noqa: B008 (frozen dataclass: the single process)
) -> Benchmark:
    """Load the configured source(s), make the tasks, hold out the validation split and put the images where
    ``data.store`` says: in memory (then ``.to(device)`` moves them) or in the on-disk cache, streamed to ``device``."""

    check_archives(cfg, ranks)

    def load(name: str, rgb_size: int | None) -> SourceData:
        if cfg.store == "device":
            source = load_named_source(name, cfg)
            return (source.as_rgb(rgb_size) if rgb_size else source).decoded()
        return cached_source(name, cfg, lambda: load_named_source(name, cfg), rgb_size, say=say, ranks=ranks)

    if cfg.source == "sequence":
        benchmark = sequence_of_datasets(cfg, load)
    elif cfg.tasks_by == "pixel_permutations":
        benchmark = permuted_tasks(load(cfg.folder if cfg.source == "image_folder" else cfg.source, None), cfg)
    else:
        benchmark = split_into_tasks(load(cfg.folder if cfg.source == "image_folder" else cfg.source, None), cfg)
    if cfg.store == "auto":
        benchmark = benchmark.placed_for(device, say, ranks)
    benchmark = benchmark.hold_out_validation(cfg.val_fraction, cfg.val_seed) if cfg.val_fraction else benchmark
    return benchmark.to(device)
