"""Malformed CIFAR files (a copy made by hand, read with data.verify_checksums=false): each one is a DataError that
names the file, the problem and the fix, never a traceback, and a pickle cannot run code while it is read."""

from __future__ import annotations

import pickle
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from clbench.config import DataConfig
from clbench.data import build_benchmark
from clbench.data.sources import load_cifar_source
from clbench.errors import DataError
from conftest import TINY, clbench
from test_data import _images, _pickle, cifar_config, write_cifar10, write_cifar100

FIX = "data.download=true"


def _cifar100(root: Path) -> Path:
    """Small official-layout CIFAR-100 files (2 training images per class); returns their folder."""
    write_cifar100(root, per_class=2)
    return root / "cifar-100-python"


def _load(path: Path) -> dict[str, Any]:
    with path.open("rb") as f:
        return pickle.load(f)


def _refused(root: Path, *phrases: str) -> str:
    """The DataError of building CIFAR-100 from ``root``, checked to name the fix and each of ``phrases``."""
    with pytest.raises(DataError) as err:
        build_benchmark(cifar_config(root, verify_checksums=False))
    message = str(err.value)
    for phrase in (*phrases, FIX, "extract the official archive"):
        assert phrase in message
    assert "\n" not in message
    return message


class _Touch:
    """A pickle that, read with an unrestricted unpickler, creates ``marker`` (``Path.touch``)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        return Path.touch, (self.marker,)


@pytest.mark.parametrize(("protocol", "name"), [(2, "__builtin__.getattr"), (4, "Path.touch")])
def test_a_pickle_that_would_call_a_function_is_refused_unrun(tmp_path: Path, protocol: int, name: str) -> None:
    folder = _cifar100(tmp_path)
    pickle.loads(pickle.dumps(_Touch(tmp_path / "proof"), protocol=protocol))
    assert (tmp_path / "proof").exists()  # the payload is live with plain pickle.load
    marker = tmp_path / "pwned"
    with (folder / "meta").open("wb") as f:
        pickle.dump({"fine_label_names": _Touch(marker)}, f, protocol=protocol)
    _refused(tmp_path, str(folder / "meta"), name, "refuses to load", "hold only arrays, lists, strings and numbers")
    assert not marker.exists()


def test_truncated_pickle(tmp_path: Path) -> None:
    folder = _cifar100(tmp_path)
    content = (folder / "train").read_bytes()
    (folder / "train").write_bytes(content[: len(content) // 2])
    _refused(tmp_path, str(folder / "train"), "is not a readable pickle", "truncated")


@pytest.mark.parametrize(
    "content",
    [b"this is a text file, not a pickle\n", np.random.default_rng(0).bytes(4096), b""],
    ids=["text", "random", "empty"],
)
def test_a_file_that_is_no_pickle(tmp_path: Path, content: bytes) -> None:
    folder = _cifar100(tmp_path)
    (folder / "test").write_bytes(content)
    _refused(tmp_path, str(folder / "test"))


@pytest.mark.parametrize(
    ("data", "problem"),
    [
        (np.zeros((200, 3000), np.uint8), "shape (200, 3000)"),
        (np.zeros((200, 3, 32, 32), np.uint8), "shape (200, 3, 32, 32)"),
        (np.zeros(200 * 3072, np.uint8), "shape (614400,)"),
        ([[0] * 3072] * 199 + [[0] * 5], "not a rectangular array"),
        (np.zeros((200, 3072), np.float32), "dtype float32"),
        (np.full((200, 3072), 256), "pixel values 256..256"),
    ],
    ids=["width", "4d", "1d", "ragged", "float", "range"],
)
def test_data_that_is_not_rows_of_3072_pixels(tmp_path: Path, data: Any, problem: str) -> None:
    folder = _cifar100(tmp_path)
    contents = _load(folder / "train")
    _pickle(folder / "train", {**contents, "data": data})
    _refused(tmp_path, str(folder / "train"), problem)


@pytest.mark.parametrize(("count", "problem"), [(199, "199 labels"), (201, "201 labels")])
def test_label_count_differs_from_image_count(tmp_path: Path, count: int, problem: str) -> None:
    folder = _cifar100(tmp_path)
    contents = _load(folder / "train")
    labels = (contents["fine_labels"] * 2)[:count]
    _pickle(folder / "train", {**contents, "fine_labels": labels})
    _refused(tmp_path, str(folder / "train"), f"{problem} in 'fine_labels' for 200 images")


@pytest.mark.parametrize(
    ("label", "problem"), [(150, "label 150"), (-1, "label -1"), (2.5, "dtype float64"), ("7", "dtype <U")]
)
def test_label_out_of_range_or_not_an_integer(tmp_path: Path, label: Any, problem: str) -> None:
    folder = _cifar100(tmp_path)
    contents = _load(folder / "test")
    _pickle(folder / "test", {**contents, "fine_labels": [*contents["fine_labels"][:-1], label]})
    message = _refused(tmp_path, str(folder / "test"), problem)
    assert "outside 0..99" in message or "not integers" in message


def test_cifar10_label_out_of_range(tmp_path: Path) -> None:
    write_cifar10(tmp_path)
    path = tmp_path / "cifar-10-batches-py" / "data_batch_3"
    _pickle(path, {"data": _images(np.arange(10)), "labels": [*range(9), 10]})
    cfg = DataConfig(name="c", source="cifar10", tasks=5, root=str(tmp_path), verify_checksums=False)
    with pytest.raises(DataError, match=r"data_batch_3 has label 10 in 'labels', outside 0\.\.9"):
        load_cifar_source(cfg, "cifar10")


def test_missing_entries_name_the_keys_the_file_has(tmp_path: Path) -> None:
    folder = _cifar100(tmp_path)
    contents = _load(folder / "train")
    _pickle(folder / "train", {"data": contents["data"], "labels": contents["fine_labels"]})
    _refused(tmp_path, str(folder / "train"), "has no 'fine_labels' entry", "'data', 'labels'")


def test_a_train_file_without_images_is_refused(tmp_path: Path) -> None:
    folder = _cifar100(tmp_path)
    _pickle(folder / "train", {"data": np.zeros((0, 3072), np.uint8), "fine_labels": []})
    _refused(tmp_path, str(folder / "train"), "holds no images")


@pytest.mark.parametrize("obj", [[1, 2, 3], np.zeros((2, 3072), np.uint8), "data"], ids=["list", "array", "str"])
def test_a_top_level_object_that_is_not_a_dict(tmp_path: Path, obj: Any) -> None:
    folder = _cifar100(tmp_path)
    _pickle(folder / "train", obj)
    _refused(tmp_path, str(folder / "train"), f"holds a {type(obj).__name__}, not the dict")


@pytest.mark.parametrize(
    ("meta", "problem"),
    [
        ({"coarse_label_names": []}, "has no 'fine_label_names' entry"),
        ({"fine_label_names": [f"c{i}" for i in range(99)]}, "lists 99 class names in 'fine_label_names', not 100"),
        ({"fine_label_names": "apple"}, "not a list of class names"),
        ({"fine_label_names": list(range(100))}, "not a list of class names"),
    ],
    ids=["missing", "99", "str", "ints"],
)
def test_meta_without_the_right_class_names(tmp_path: Path, meta: dict[str, Any], problem: str) -> None:
    folder = _cifar100(tmp_path)
    _pickle(folder / "meta", meta)
    _refused(tmp_path, str(folder / "meta"), problem)


def test_cifar10_meta_without_label_names(tmp_path: Path) -> None:
    write_cifar10(tmp_path)
    path = tmp_path / "cifar-10-batches-py" / "batches.meta"
    _pickle(path, {"num_cases_per_batch": 10})
    cfg = DataConfig(name="c", source="cifar10", tasks=5, root=str(tmp_path), verify_checksums=False)
    with pytest.raises(DataError, match=r"batches\.meta has no 'label_names' entry"):
        load_cifar_source(cfg, "cifar10")


def _bytes_keys(obj: Any) -> Any:
    """``obj`` as pickles written with ``encoding='bytes'`` habits hold it: bytes keys and bytes strings."""
    if isinstance(obj, dict):
        return {k.encode(): _bytes_keys(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_bytes_keys(v) for v in obj]
    return obj.encode() if isinstance(obj, str) else obj


class _Python2Pickler(pickle._Pickler):
    """Writes bytes as Python 2 strings (BINSTRING), as the official archive's Python 2 pickles hold them."""

    dispatch = pickle._Pickler.dispatch.copy()

    def save_py2_str(self, obj: bytes) -> None:
        self.write(pickle.BINSTRING + struct.pack("<i", len(obj)) + obj)
        self.memoize(obj)

    dispatch[bytes] = save_py2_str


def _python2_pickle(path: Path, obj: Any) -> None:
    """``obj`` as the official archive's pickles hold it: protocol 2, Python 2 strings, numpy 1.x module names."""
    with path.open("wb") as f:
        _Python2Pickler(f, protocol=2).dump(_bytes_keys(obj))
    path.write_bytes(path.read_bytes().replace(b"numpy._core.", b"numpy.core."))


@pytest.mark.parametrize(
    ("write", "protocol"),
    [("bytes_keys", 2), ("bytes_keys", 5), ("str_keys", 4), ("str_keys", 5), ("python2", 2), ("numpy_labels", 2)],
)
def test_other_pickle_flavours_load_identically(tmp_path: Path, write: str, protocol: int) -> None:
    """Bytes keys and names, protocols 4 and 5, the official archive's Python 2 pickles and numpy-integer labels
    read exactly as the protocol 2 files of test_data do."""
    _cifar100(tmp_path / "a")
    expected = load_cifar_source(cifar_config(tmp_path / "a", verify_checksums=False), "cifar100")
    for path in _cifar100(tmp_path / "b").iterdir():
        contents = _load(path)
        if write == "python2":
            _python2_pickle(path, contents)
        elif write == "numpy_labels" and "fine_labels" in contents:  # a list of numpy integers, not of ints
            _pickle(path, {**contents, "fine_labels": list(np.asarray(contents["fine_labels"]))})
        else:
            with path.open("wb") as f:
                pickle.dump(_bytes_keys(contents) if write == "bytes_keys" else contents, f, protocol=protocol)
    got = load_cifar_source(cifar_config(tmp_path / "b", verify_checksums=False), "cifar100")
    for name in ("train_x", "train_y", "test_x", "test_y"):
        assert torch.equal(getattr(got, name), getattr(expected, name))
    assert got.class_names == expected.class_names == [f"c{i}" for i in range(100)]


def test_cli_reports_a_damaged_file_in_one_paragraph(tmp_path: Path) -> None:
    folder = _cifar100(tmp_path / "data")
    _pickle(folder / "train", {"data": np.zeros((200, 3000), np.uint8), "fine_labels": [0] * 200})
    overrides = [o for o in TINY if not o.startswith("data")]
    done = clbench(
        *overrides,
        "data=cifar100_10tasks",
        f"data.root={tmp_path / 'data'}",
        "data.verify_checksums=false",
        "trainer.epochs=1",
        f"hydra.run.dir={tmp_path / 'run'}",
        cwd=tmp_path,
    )
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert f"The CIFAR file {folder / 'train'} has 'data' of shape (200, 3000)" in done.stderr
    assert FIX in done.stderr
