"""Dataset sources: each returns uint8 images (N, C, H, W) with their original labels.

- ``digits``: scikit-learn's bundled 8x8 handwritten digits (real images, no download), split 70/30
  stratified with a fixed seed.
- ``cifar10`` / ``cifar100``: the official python pickles, downloaded into ``data.root`` on request with
  torchvision's checksummed downloader, read directly into tensors (no PIL).
- ``synthetic``: seeded class prototypes plus noise, for tests and timings without files.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torchvision.datasets import CIFAR10, CIFAR100
from torchvision.datasets.utils import check_integrity, download_and_extract_archive

from clbench.config import DataConfig
from clbench.errors import DataError


@dataclass
class SourceData:
    """A whole labelled dataset before it is split into tasks."""

    train_x: torch.Tensor  # uint8 (N, C, H, W)
    train_y: torch.Tensor  # int64 original labels
    test_x: torch.Tensor
    test_y: torch.Tensor
    class_names: list[str]


def load_digits_source() -> SourceData:
    """scikit-learn's digits: 1,797 8x8 greyscale images of 10 classes (values 0..16 scaled to 0..255)."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    images = np.round(digits.images * (255.0 / 16.0)).astype(np.uint8)[:, None]  # (N, 1, 8, 8)
    x_tr, x_te, y_tr, y_te = train_test_split(
        images, digits.target, test_size=0.3, stratify=digits.target, random_state=0
    )
    return SourceData(
        torch.from_numpy(x_tr),
        torch.from_numpy(y_tr).long(),
        torch.from_numpy(x_te),
        torch.from_numpy(y_te).long(),
        [str(d) for d in digits.target_names],
    )


def load_synthetic_source(cfg: DataConfig) -> SourceData:
    """Each class is a fixed smooth random image; samples add Gaussian noise. Learnable, deterministic."""
    gen = torch.Generator().manual_seed(0)
    n_cls, size, ch = cfg.synthetic_classes, cfg.synthetic_image_size, cfg.synthetic_channels
    coarse = torch.rand(n_cls, ch, 4, 4, generator=gen)
    protos = torch.nn.functional.interpolate(coarse, size=(size, size), mode="bilinear", align_corners=False)

    def sample(per_class: int) -> tuple[torch.Tensor, torch.Tensor]:
        y = torch.arange(n_cls).repeat_interleave(per_class)
        noise = 0.15 * torch.randn(len(y), ch, size, size, generator=gen)
        x = ((protos[y] + noise).clamp(0, 1) * 255).round().to(torch.uint8)
        return x, y

    train_x, train_y = sample(cfg.synthetic_train_per_class)
    test_x, test_y = sample(cfg.synthetic_test_per_class)
    return SourceData(train_x, train_y, test_x, test_y, [f"class_{i}" for i in range(n_cls)])


def _read_pickle(path: Path) -> dict:
    with path.open("rb") as f:
        return pickle.load(f, encoding="latin1")


def _cifar_arrays(files: list[Path], label_key: str) -> tuple[torch.Tensor, torch.Tensor]:
    batches = [_read_pickle(f) for f in files]
    x = np.concatenate([b["data"] for b in batches]).reshape(-1, 3, 32, 32)
    y = np.concatenate([np.asarray(b[label_key]) for b in batches])
    return torch.from_numpy(np.ascontiguousarray(x, dtype=np.uint8)), torch.from_numpy(y).long()


def load_cifar_source(cfg: DataConfig) -> SourceData:
    """CIFAR-10/100 from ``<root>/cifar-{10-batches,100}-py`` (the official archive's layout)."""
    spec = CIFAR100 if cfg.source == "cifar100" else CIFAR10
    root = Path(cfg.root).expanduser()
    folder = root / spec.base_folder
    files = [*spec.train_list, *spec.test_list, [spec.meta["filename"], spec.meta["md5"]]]

    def present() -> bool:
        if cfg.verify_checksums:
            return all(check_integrity(str(folder / name), md5) for name, md5 in files)
        return all((folder / name).is_file() for name, _ in files)

    if not present() and cfg.download:
        try:
            md5 = spec.tgz_md5 if cfg.verify_checksums else None
            download_and_extract_archive(spec.url, str(root), filename=spec.filename, md5=md5)
        except Exception as err:  # network errors, bad archives: all end the same way for the user
            raise DataError(
                f"Could not download {cfg.source} from {spec.url} into {root} ({type(err).__name__}: {err}). "
                f"Without network, copy the official archive {spec.filename} there and extract it, "
                f"so that {folder} holds {', '.join(n for n, _ in files)}."
            ) from None
    if not present():
        what = "missing or fail their checksums" if cfg.verify_checksums else "are missing"
        raise DataError(
            f"The {cfg.source} files in {folder} {what}. Either run with data.download=true (needs network) "
            f"or download {spec.url}, extract it into {root} so that {folder} holds "
            f"{', '.join(n for n, _ in files)}, and point data.root at it"
            + ("; data.verify_checksums=false accepts a copy you made yourself." if cfg.verify_checksums else ".")
        )
    label_key = "fine_labels" if cfg.source == "cifar100" else "labels"
    train_x, train_y = _cifar_arrays([folder / n for n, _ in spec.train_list], label_key)
    test_x, test_y = _cifar_arrays([folder / n for n, _ in spec.test_list], label_key)
    meta = _read_pickle(folder / spec.meta["filename"])
    return SourceData(train_x, train_y, test_x, test_y, list(meta[spec.meta["key"]]))


def load_source(cfg: DataConfig) -> SourceData:
    if cfg.source == "digits":
        return load_digits_source()
    if cfg.source == "synthetic":
        return load_synthetic_source(cfg)
    return load_cifar_source(cfg)
