"""The data entries of `make bench`: the streaming store against torchvision's ImageFolder + DataLoader, the share of a
training step spent waiting for streamed data, and memory as the dataset grows.

- ``data/stream``: batches of a JPEG image folder through ``data.store=stream`` (decoded once into the cache before
  the timing; then read from it by ``--workers`` processes) as the training loop gets them: uint8 on the device.
- ``reference/imagefolder``: the same folder through ``torchvision.datasets.ImageFolder`` + ``DataLoader`` (PIL decode,
  Resize + CenterCrop to the storage size, the same worker count, pinned memory on CUDA), what most CL codebases run.
- ``finetune/stream``: finetune's training step fed from the stream; ``data %`` is the share of the step spent waiting
  for the next batch (on CUDA the copy of batch i+1 overlaps step i).
- ``data/stream_x{1,10,100}`` and ``data/device_x{1,10,100}``: one epoch's first ``--steps`` batches of 1, 10 and 100
  times CIFAR-100's test set (10,000 images of 3 x 32 x 32), streamed or held in memory; ``peak MB`` is the process's
  peak anonymous resident memory (read in the process: ``stream_workers=0``; the page cache that the memory-mapped
  arrays go through belongs to the kernel, which reclaims it) or, on CUDA, the peak allocated device memory.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from clbench.bench.timing import Entry, cycle, device_of

DATA = ("data/stream", "reference/imagefolder", "finetune/stream")
SCALES = (1, 10, 100)
MEMORY = tuple(f"data/{store}_x{k}" for store in ("stream", "device") for k in SCALES)
ENTRIES = (*DATA, *MEMORY)
TEST_SET = 10_000  # CIFAR-100's test set: the unit of the memory entries


def write_jpeg_folder(folder: Path, images: int, side: int, classes: int = 10) -> None:
    """``images`` smooth random JPEGs of ``side`` px in ``folder/{train,test}/<class>/``: every 50th round of the
    classes is a test round, so both halves hold every class (a split archive's layout)."""
    from PIL import Image

    rng = np.random.default_rng(0)
    for i in range(images):
        split = "test" if (i // classes) % 50 == 0 else "train"
        sub = folder / split / f"class_{i % classes}"
        sub.mkdir(parents=True, exist_ok=True)
        coarse = rng.integers(0, 256, (4, 4, 3), dtype=np.uint8)
        img = Image.fromarray(coarse).resize((side, side), Image.Resampling.BICUBIC)
        noise = rng.integers(-12, 13, (side, side, 3))
        Image.fromarray(np.clip(np.asarray(img, dtype=np.int16) + noise, 0, 255).astype(np.uint8)).save(
            sub / f"{i}.jpg", quality=90
        )


def prepare(args: argparse.Namespace) -> None:
    """Write the bench's JPEG folder once (in the parent, before the entries' processes start)."""
    folder = args.data_dir / "jpegs"
    if not (folder / "train").is_dir():
        write_jpeg_folder(folder, args.data_images, max(48, args.image_size * 3 // 2))


def stream_overrides(args: argparse.Namespace) -> tuple[str, ...]:
    """The JPEG folder as one task of a streamed image-folder benchmark."""
    return (
        "data.name=bench",
        "data.source=image_folder",
        "data.folder=jpegs",
        "data.tasks=1",
        "data.num_tasks=null",
        f"data.root={args.data_dir}",
        f"data.cache_dir={args.data_dir / 'cache'}",
        f"data.store_size={args.image_size}",
        "data.store=stream",
        f"data.stream_workers={args.workers}",
        f"data.decode_workers={max(1, args.workers)}",
    )


def stream_step(args: argparse.Namespace) -> Entry:
    from clbench.bench.timing import compose
    from clbench.data import build_benchmark

    cfg = compose(["data=synthetic_tiny", *stream_overrides(args)])
    device = device_of(args)
    split = build_benchmark(cfg.data, device).train[0]
    return Entry(cycle(lambda: split.batches(args.batch_size, shuffle=True)), device)


def imagefolder_step(args: argparse.Namespace) -> Entry:
    from torch.utils.data import DataLoader
    from torchvision.datasets import ImageFolder
    from torchvision.transforms import v2

    device = device_of(args)
    size = args.image_size
    transform = v2.Compose([v2.PILToTensor(), v2.Resize(size, antialias=True), v2.CenterCrop(size)])
    loader = DataLoader(
        ImageFolder(str(args.data_dir / "jpegs" / "train"), transform=transform),
        batch_size=args.batch_size,
        shuffle=True,
        num_workers=args.workers,
        pin_memory=device.type == "cuda",
        persistent_workers=args.workers > 0,
        drop_last=True,
    )

    def batches() -> Iterator[torch.Tensor]:
        return (x.to(device, non_blocking=True) for x, _ in loader)

    return Entry(cycle(batches), device)


def finetune_stream_step(args: argparse.Namespace) -> Entry:
    """Finetune's real step on streamed batches of the JPEG folder; returns the step and a probe of the waiting time."""
    from clbench.bench.models import method_step

    return method_step(args, "finetune", stream_overrides(args))


def memory_step(args: argparse.Namespace, name: str) -> Entry:
    """An epoch over ``k`` x CIFAR-100's test set of random 32 px images, streamed or held (see the module's doc)."""
    from clbench.data.benchmark import Split
    from clbench.data.stream import DiskImages

    store, k = name.removeprefix("data/").split("_x")
    count, device = TEST_SET * int(k), device_of(args)
    path = args.data_dir / f"memory_x{k}.npy"
    if not path.is_file():
        array = np.lib.format.open_memmap(path, mode="w+", dtype=np.uint8, shape=(count, 3, 32, 32))
        rng = np.random.default_rng(0)
        for lo in range(0, count, 100_000):
            array[lo : lo + 100_000] = rng.integers(0, 256, array[lo : lo + 100_000].shape, dtype=np.uint8)
        array.flush()
        del array
    images = DiskImages.whole(path, (count, 3, 32, 32), workers=0).to(device)
    labels = torch.zeros(count, dtype=torch.long, device=device)
    x = images if store == "stream" else torch.from_numpy(np.load(path)).to(device)
    split = Split(x, labels)
    batch = cycle(lambda: split.batches(args.batch_size, shuffle=True))

    def step() -> None:
        batch()
        AnonPeak.sample()

    return Entry(step, device)


def build(args: argparse.Namespace, name: str) -> Entry:
    if name == "data/stream":
        return stream_step(args)
    if name == "reference/imagefolder":
        return imagefolder_step(args)
    if name == "finetune/stream":
        return finetune_stream_step(args)
    return memory_step(args, name)


def anon_mb() -> float:
    """This process's anonymous resident memory (MiB; Linux's RssAnon), 0 where /proc is missing."""
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return 0.0
    line = next((s for s in status.splitlines() if s.startswith("RssAnon:")), "RssAnon: 0 kB")
    return int(line.split()[1]) / 1024


class AnonPeak:
    """The peak of :func:`anon_mb` over the samples taken since :meth:`reset`."""

    peak = 0.0

    @classmethod
    def reset(cls) -> None:
        cls.peak = anon_mb()

    @classmethod
    def sample(cls) -> None:
        cls.peak = max(cls.peak, anon_mb())
