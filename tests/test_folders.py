"""Image folders, MNIST/SVHN files and dataset sequences, written by the tests in their real on-disk formats."""

from __future__ import annotations

import hashlib
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from scipy.io import savemat

from clbench.config import DataConfig
from clbench.data import build_benchmark
from clbench.errors import ConfigError, DataError
from clbench.loop import train
from conftest import TINY, compose_config
from test_data import write_cifar10


def write_image_folder(folder: Path, classes: list[str], per_class: int, *, split: bool) -> None:
    """PNG files of mixed sizes and modes (RGB, greyscale); pixel value encodes the class index."""
    for c, name in enumerate(classes):
        for i in range(per_class):
            sub = folder / ("test" if split and i == 0 else "train" if split else "") / name
            sub.mkdir(parents=True, exist_ok=True)
            mode, size = ("L", (20, 30)) if i % 2 else ("RGB", (40, 24))
            Image.new(mode, size, color=10 * c if mode == "L" else (10 * c,) * 3).save(sub / f"{i}.png")


def write_idx(raw: Path, prefix: str, n: int) -> None:
    """MNIST's idx format: big-endian magic, dimensions, then uint8 data."""
    raw.mkdir(parents=True, exist_ok=True)
    labels = np.arange(n, dtype=np.uint8) % 10
    (raw / f"{prefix}-images-idx3-ubyte").write_bytes(struct.pack(">IIII", 2051, n, 28, 28) + bytes(n * 28 * 28))
    (raw / f"{prefix}-labels-idx1-ubyte").write_bytes(struct.pack(">II", 2049, n) + labels.tobytes())


def write_five_datasets(root: Path) -> None:
    write_cifar10(root)
    for name in ("MNIST", "FashionMNIST"):
        write_idx(root / name / "raw", "train", 20)
        write_idx(root / name / "raw", "t10k", 10)
    (root / "svhn").mkdir()
    for split, n in (("train", 20), ("test", 10)):
        x = np.zeros((32, 32, 3, n), dtype=np.uint8)
        savemat(str(root / "svhn" / f"{split}_32x32.mat"), {"X": x, "y": (np.arange(n) % 10 + 1).reshape(-1, 1)})
    write_image_folder(root / "notmnist", list("ABCDEFGHIJ"), 5, split=False)


def folder_config(root: Path, **kw) -> DataConfig:
    return DataConfig(
        **{
            "name": "folder",
            "source": "image_folder",
            "folder": "ds",
            "tasks": 2,
            "root": str(root),
            "store_size": 16,
            **kw,
        }
    )


def test_image_folder_with_its_own_split(tmp_path: Path) -> None:
    write_image_folder(tmp_path / "ds", ["bird", "cat", "dog", "eel"], 3, split=True)
    bench = build_benchmark(folder_config(tmp_path, class_order_seed=None))
    assert [t.class_names for t in bench.tasks] == [("bird", "cat"), ("dog", "eel")]
    assert bench.train[0].x.shape == (4, 3, 16, 16) and bench.train[0].x.dtype == torch.uint8
    assert len(bench.test[1]) == 2
    files = sorted(str(f.relative_to(tmp_path / "ds")) for f in (tmp_path / "ds").rglob("*.png"))
    assert bench.splits == [  # its own split, identified by the SHA-256 of the sorted relative paths
        {
            "folder": "ds",
            "split": "train/ and test/",
            "classes": 4,
            "train_images": 8,
            "test_images": 4,
            "files_sha256": hashlib.sha256("\n".join(files).encode()).hexdigest(),
        }
    ]
    assert bench.train[1].x[bench.train[1].y == 3].float().mean().item() == pytest.approx(30.0, abs=1)  # eel = 30


def test_image_folder_without_split_is_split_by_seed_and_recorded(tmp_path: Path) -> None:
    write_image_folder(tmp_path / "ds", ["a", "b"], 10, split=False)
    first = build_benchmark(folder_config(tmp_path, test_fraction=0.2))
    again = build_benchmark(folder_config(tmp_path, test_fraction=0.2))
    other = build_benchmark(folder_config(tmp_path, test_fraction=0.2, split_seed=1))
    assert sum(len(s) for s in first.test) == 4 and sum(len(s) for s in first.train) == 16  # 2 of 10 per class
    record = first.splits[0]
    assert record["seed"] == 0 and record["test_images"] == 4 and len(record["test_files_sha256"]) == 64
    assert again.splits == first.splits and other.splits[0]["test_files_sha256"] != record["test_files_sha256"]


def test_unreadable_image_and_missing_folder_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"ds/train/<class>"):
        build_benchmark(folder_config(tmp_path))
    write_image_folder(tmp_path / "ds", ["a", "b"], 3, split=True)
    (tmp_path / "ds" / "train" / "a" / "broken.jpg").write_bytes(b"not an image")
    with pytest.raises(DataError, match=r"broken\.jpg"):
        build_benchmark(folder_config(tmp_path))


def test_five_datasets_reads_every_format_into_one_task_each(tmp_path: Path) -> None:
    write_five_datasets(tmp_path)
    cfg = compose_config("data=five_datasets", f"data.root={tmp_path}", "data.verify_checksums=false").data
    bench = build_benchmark(DataConfig(**cfg))
    assert [t.num_classes for t in bench.tasks] == [10] * 5 and [t.offset for t in bench.tasks] == [0, 10, 20, 30, 40]
    assert bench.tasks[3].class_names[0] == "notmnist/A" and bench.tasks[1].class_names[0].startswith("mnist/0")
    for t, (tr, te) in enumerate(zip(bench.train, bench.test, strict=True)):
        assert tr.x.shape[1:] == (3, 32, 32) and te.x.shape[1:] == (3, 32, 32)
        assert tr.y.min() >= 10 * t and tr.y.max() < 10 * (t + 1)
    assert sorted(bench.train[2].y.unique().tolist()) == list(range(20, 30))  # SVHN's label 10 is digit 0
    assert bench.splits[0]["folder"] == "notmnist"


def test_a_method_runs_on_a_sequence_and_records_the_split(tmp_path: Path) -> None:
    data = tmp_path / "data"
    write_five_datasets(data)
    overrides = [o for o in TINY if not o.startswith("data")]
    cfg = compose_config(
        *overrides, "data=five_datasets", f"data.root={data}", "data.verify_checksums=false", "data.num_tasks=2"
    )
    from clbench.config import validate

    results = train(validate(cfg), tmp_path / "run")
    assert results.status == "finished" and results.header["benchmark"] == "five_datasets_first2"  # 2 of its 5 tasks
    assert len(results.rows["til"]) == 2


def test_sequence_needs_one_task_per_dataset_and_a_store_size() -> None:
    with pytest.raises(ConfigError, match=r"data\.tasks"):
        DataConfig(name="s", source="sequence", tasks=3, datasets=["cifar10", "mnist"], store_size=32)
    with pytest.raises(ConfigError, match=r"data\.store_size"):
        DataConfig(name="s", source="sequence", tasks=1, datasets=["cifar10"])


def test_meat_sequence_without_its_folders_names_the_first_missing_one(tmp_path: Path) -> None:
    cfg = compose_config("data=meat_sequence", f"data.root={tmp_path}").data
    with pytest.raises(DataError, match=r"cub200"):
        build_benchmark(DataConfig(**cfg))
