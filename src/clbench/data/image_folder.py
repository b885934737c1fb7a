"""Datasets stored as image folders (one sub-folder per class), decoded once into uint8 images.

Layouts under ``<data.root>/<folder>``:
- ``train/<class>/*`` and ``test/<class>/*``: the dataset's own split (CUB-200, Stanford Cars, ...);
- ``<class>/*`` only: split per class with ``data.split_seed`` into ``1 - test_fraction`` / ``test_fraction``
  (ImageNet-R, notMNIST); the split is fixed by the seed and recorded with the run.
Every image is decoded with PIL (in a thread pool), converted to RGB, centre-cropped to a square and resized
to ``data.store_size``: the device-side transforms do the rest per batch.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from clbench.data.decoding import LazyImages
from clbench.errors import DataError

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp"}


def list_classes(folder: Path) -> list[str]:
    classes = sorted(p.name for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not classes:
        raise DataError(f"{folder} holds no class sub-folders (expected {folder}/<class>/<image files>).")
    return classes


def list_images(folder: Path, classes: list[str]) -> tuple[list[Path], np.ndarray]:
    files, labels = [], []
    for label, name in enumerate(classes):
        found = sorted(p for p in (folder / name).rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES)
        files += found
        labels += [label] * len(found)
    return files, np.asarray(labels, dtype=np.int64)


def load_image(path: Path, size: int, *, short_side: bool = False) -> np.ndarray:
    """RGB, (3, size, size) uint8: the image's centre square resized to size (bicubic), or with ``short_side``
    torchvision's Resize(size) + CenterCrop(size) on the PIL image (the short side to size, the long one to
    int(size x long / short), then the centred square at whole-pixel offsets): what PILOT's test path crops from."""
    try:
        with Image.open(path) as img:
            rgb = img.convert("RGB")
            if short_side:
                square = resized_centre(rgb, size)
            else:
                square = ImageOps.fit(rgb, (size, size), method=Image.Resampling.BICUBIC)
            return np.array(square, dtype=np.uint8).transpose(2, 0, 1)  # a copy: writable
    except (OSError, UnidentifiedImageError) as err:
        raise DataError(f"Could not read the image {path} ({err}); remove or replace the file.") from None


def resized_centre(img: Image.Image, size: int) -> Image.Image:
    """torchvision's Resize(size, bicubic) then CenterCrop(size) of a PIL image."""
    w, h = img.size
    short, long = (w, h) if w <= h else (h, w)
    long = int(size * long / short)
    w, h = (size, long) if w <= h else (long, size)
    resized = img.resize((w, h), Image.Resampling.BICUBIC)
    left, top = round((w - size) / 2), round((h - size) / 2)  # torchvision: int(round(x / 2.0)), half to even
    return resized.crop((left, top, left + size, top + size))


def load_images(files: list[Path], size: int, workers: int, *, short_side: bool = False) -> LazyImages:
    """The images of ``files`` as :func:`load_image` decodes them, on demand."""
    return LazyImages(len(files), size, workers, lambda i: load_image(files[i], size, short_side=short_side))


def seeded_split(labels: np.ndarray, test_fraction: float, seed: int) -> np.ndarray:
    """A boolean test mask holding round(test_fraction * n_c) images of each class c (at least one when n_c > 1)."""
    rng = np.random.RandomState(seed)
    test = np.zeros(len(labels), dtype=bool)
    for c in np.unique(labels):
        idx = np.flatnonzero(labels == c)
        n = min(len(idx) - 1, max(1, round(test_fraction * len(idx)))) if len(idx) > 1 else 0
        test[rng.permutation(idx)[:n]] = True
    return test


def split_digest(files: list[Path], root: Path) -> str:
    """SHA-256 of the sorted relative paths: identifies a seeded split in results.json."""
    names = "\n".join(sorted(str(f.relative_to(root)) for f in files))
    return hashlib.sha256(names.encode()).hexdigest()
