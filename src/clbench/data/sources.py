"""Dataset sources: each returns uint8 images (N, C, H, W) with their original labels.

- ``digits``: scikit-learn's bundled 8x8 handwritten digits (real images, no download), split 70/30
  stratified with a fixed seed.
- ``cifar10`` / ``cifar100``: the official python pickles, downloaded into ``data.root`` on request with
  torchvision's checksummed downloader, read directly into tensors (no PIL).
- ``mnist`` / ``fashion_mnist``: the official idx files (torchvision's layout ``<root>/<MNIST|FashionMNIST>/raw``),
  read with torchvision's readers; ``svhn``: the official ``{train,test}_32x32.mat`` files in ``<root>/svhn``.
- ``gtsrb``, ``flowers102``, ``stanford_cars``: their official layouts through torchvision's readers; ``cub200``:
  CUB-200-2011's official layout. These are decoded on demand (:class:`LazyImages`), straight to ``data.store_size``.
- ``image_folder``: ``<root>/<data.folder>`` with one sub-folder per class (:mod:`clbench.data.image_folder`), or
  ``train``/``test`` (or ``val``) sub-folders of classes.
- ``synthetic``: seeded class prototypes plus noise, for tests and timings without files.
A ``sequence`` benchmark loads several of these by name (a name that is none of them is an image folder).
"""

from __future__ import annotations

import codecs
import importlib
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import ConcatDataset
from torchvision.datasets import CIFAR10, CIFAR100, MNIST, SVHN, FashionMNIST
from torchvision.datasets.mnist import read_image_file, read_label_file
from torchvision.datasets.utils import check_integrity, download_and_extract_archive, download_url

from clbench.config import DataConfig
from clbench.data.decoding import LazyImages, materialized
from clbench.data.image_folder import list_classes, list_images, load_images, seeded_split, split_digest
from clbench.data.split_lists import read_split_lists, require_listed_files
from clbench.errors import DataError


@dataclass
class SourceData:
    """A whole labelled dataset before it is split into tasks."""

    train_x: torch.Tensor | LazyImages  # uint8 (N, C, H, W); image files are decoded on demand
    train_y: torch.Tensor  # int64 original labels
    test_x: torch.Tensor | LazyImages
    test_y: torch.Tensor
    class_names: list[str]
    split: dict[str, Any] | None = None  # how a seeded train/test split was made (recorded in results.json)

    def as_rgb(self, size: int) -> SourceData:
        """Three channels at size x size (antialiased resize), so that datasets of a sequence stack alike. Image files
        are decoded that way already."""

        def convert(x: torch.Tensor | LazyImages) -> torch.Tensor | LazyImages:
            if isinstance(x, LazyImages):
                assert x.shape[1:] == (3, size, size)
                return x
            x = x.expand(-1, 3, -1, -1) if x.shape[1] == 1 else x
            if x.shape[-2:] == (size, size):
                return x.contiguous()
            chunks = [
                F.interpolate(c.float(), size=(size, size), mode="bilinear", antialias=True, align_corners=False)
                .round()
                .clamp(0, 255)
                .to(torch.uint8)
                for c in x.split(4096)
            ]
            return torch.cat(chunks) if chunks else torch.zeros(0, 3, size, size, dtype=torch.uint8)

        return SourceData(
            convert(self.train_x), self.train_y, convert(self.test_x), self.test_y, self.class_names, self.split
        )

    def decoded(self) -> SourceData:
        """The same data with every image decoded into a tensor."""
        x = materialized(self.train_x), materialized(self.test_x)
        return SourceData(x[0], self.train_y, x[1], self.test_y, self.class_names, self.split)


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


def _pickle_globals() -> dict[tuple[str, str], Any]:
    """The only globals a CIFAR pickle may name: what rebuilds numpy arrays, dtypes and scalars (under numpy 1.x's
    ``numpy.core`` and 2.x's ``numpy._core`` names, whichever wrote the file) and bytes as Python 3 pickles them."""
    core = "numpy._core" if np.lib.NumpyVersion(np.__version__) >= "2.0.0" else "numpy.core"
    multiarray = importlib.import_module(f"{core}.multiarray")
    numeric = importlib.import_module(f"{core}.numeric")
    allowed: dict[tuple[str, str], Any] = {
        ("numpy", "ndarray"): np.ndarray,
        ("numpy", "dtype"): np.dtype,
        ("_codecs", "encode"): codecs.encode,  # bytes in protocol 0-2 pickles written by Python 3
        ("__builtin__", "bytes"): bytes,  # empty bytes in those
    }
    for prefix in ("numpy.core", "numpy._core"):
        allowed[(f"{prefix}.multiarray", "_reconstruct")] = multiarray._reconstruct
        allowed[(f"{prefix}.multiarray", "scalar")] = multiarray.scalar
        allowed[(f"{prefix}.numeric", "_frombuffer")] = numeric._frombuffer  # arrays in protocol 5 pickles
    return allowed


_PICKLE_GLOBALS = _pickle_globals()


def _damaged(path: Path, problem: str) -> DataError:
    """The error for a CIFAR file that cannot be used: the file, what is wrong with it and how to replace it."""
    return DataError(
        f"The CIFAR file {path} {problem}. Replace it with the official file: extract the official archive again "
        f"into {path.parent.parent}, or delete {path.parent} and run with data.download=true (needs network); "
        "data.verify_checksums=true (the default) refuses a damaged copy before reading it."
    )


class _CifarUnpickler(pickle.Unpickler):
    """Rebuilds only dicts, lists, strings, bytes, numbers and numpy arrays; any other global is refused, so that a
    pickle cannot run code while it is read."""

    def __init__(self, path: Path, file: BinaryIO) -> None:
        super().__init__(file, encoding="latin1")  # latin1: the official files are Python 2 pickles
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in _PICKLE_GLOBALS:
            raise _damaged(
                self.path,
                f"names the global {module}.{name}, which clbench refuses to load: CIFAR pickles hold only arrays, "
                "lists, strings and numbers",
            )
        return _PICKLE_GLOBALS[(module, name)]


def _text(value: str | bytes) -> str:
    """Bytes as the latin1 text that Python 2 strings become with ``encoding="latin1"``; text unchanged."""
    return value.decode("latin1") if isinstance(value, bytes) else value


def _read_pickle(path: Path) -> dict[Any, Any]:
    """A CIFAR pickle's dict, read with :class:`_CifarUnpickler`; bytes keys (``b"data"``) become text."""
    try:
        with path.open("rb") as f:
            obj = _CifarUnpickler(path, f).load()
    except DataError:
        raise
    except Exception as err:  # a truncated file or one that is no pickle fails with many kinds of errors
        raise _damaged(
            path, f"is not a readable pickle ({type(err).__name__}: {err}): it is truncated or damaged"
        ) from None
    if not isinstance(obj, dict):
        raise _damaged(path, f"holds a {type(obj).__name__}, not the dict of a CIFAR file")
    return {_text(k) if isinstance(k, str | bytes) else k: v for k, v in obj.items()}


def _entry(path: Path, contents: dict[Any, Any], key: str) -> Any:
    """``contents[key]``, or an error naming the keys the file has."""
    if key not in contents:
        raise _damaged(path, f"has no {key!r} entry (its keys: {', '.join(map(repr, contents)) or 'none'})")
    return contents[key]


def _as_array(path: Path, contents: dict[Any, Any], key: str) -> np.ndarray:
    """``contents[key]`` as a numpy array."""
    try:
        return np.asarray(_entry(path, contents, key))
    except ValueError:  # ragged nested lists
        raise _damaged(path, f"has a {key!r} entry that is not a rectangular array") from None


def _cifar_batch(path: Path, label_key: str, num_classes: int) -> tuple[np.ndarray, np.ndarray]:
    """One CIFAR file's images (N, 3072) uint8 and labels (N,), checked for shape, count and range."""
    contents = _read_pickle(path)
    data, labels = _as_array(path, contents, "data"), _as_array(path, contents, label_key)
    if data.ndim >= 1 and len(data) == 0:
        raise _damaged(path, "holds no images")
    if data.shape[1:] != (3 * 32 * 32,):
        raise _damaged(path, f"has 'data' of shape {data.shape}, not one row of 3072 = 3x32x32 pixels per image")
    if data.dtype != np.uint8 and data.dtype.kind not in "iu":
        raise _damaged(path, f"has 'data' of dtype {data.dtype}, not integer pixel values 0..255")
    if data.dtype != np.uint8 and (data.min() < 0 or data.max() > 255):
        raise _damaged(path, f"has pixel values {data.min()}..{data.max()} in 'data', outside 0..255")
    if labels.ndim != 1:
        raise _damaged(path, f"has a {label_key!r} entry of shape {labels.shape}, not a list of labels")
    if len(labels) != len(data):
        raise _damaged(path, f"has {len(labels)} labels in {label_key!r} for {len(data)} images")
    if labels.dtype.kind not in "iu":
        raise _damaged(path, f"has labels of dtype {labels.dtype} in {label_key!r}, not integers")
    bad = labels[(labels < 0) | (labels >= num_classes)]
    if bad.size:
        raise _damaged(path, f"has label {bad[0]} in {label_key!r}, outside 0..{num_classes - 1}")
    return data.astype(np.uint8, copy=False), labels


def _cifar_arrays(files: list[Path], label_key: str, num_classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    batches = [_cifar_batch(f, label_key, num_classes) for f in files]
    x = np.concatenate([data for data, _ in batches]).reshape(-1, 3, 32, 32)
    y = np.concatenate([labels for _, labels in batches])
    return torch.from_numpy(np.ascontiguousarray(x)), torch.from_numpy(y).long()


def _class_names(path: Path, key: str, num_classes: int) -> list[str]:
    """The class names in a CIFAR meta file, checked to be ``num_classes`` strings."""
    names = _entry(path, _read_pickle(path), key)
    if not isinstance(names, list | tuple) or not all(isinstance(n, str | bytes) for n in names):
        raise _damaged(path, f"has a {key!r} entry that is not a list of class names")
    if len(names) != num_classes:
        raise _damaged(path, f"lists {len(names)} class names in {key!r}, not {num_classes}")
    return [_text(n) for n in names]


def load_cifar_source(cfg: DataConfig, name: str) -> SourceData:
    """CIFAR-10/100 from ``<root>/cifar-{10-batches,100}-py`` (the official archive's layout)."""
    spec = CIFAR100 if name == "cifar100" else CIFAR10
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
                f"Could not download {name} from {spec.url} into {root} ({type(err).__name__}: {err}). "
                f"Without network, copy the official archive {spec.filename} there and extract it, "
                f"so that {folder} holds {', '.join(n for n, _ in files)}."
            ) from None
    if not present():
        what = "are missing or fail their checksums" if cfg.verify_checksums else "are missing"
        raise DataError(
            f"The {name} files in {folder} {what}. Either run with data.download=true (needs network) "
            f"or download {spec.url}, extract it into {root} so that {folder} holds "
            f"{', '.join(n for n, _ in files)}, and point data.root at it"
            + ("; data.verify_checksums=false accepts a copy you made yourself." if cfg.verify_checksums else ".")
        )
    label_key, num_classes = ("fine_labels", 100) if name == "cifar100" else ("labels", 10)
    train_x, train_y = _cifar_arrays([folder / n for n, _ in spec.train_list], label_key, num_classes)
    test_x, test_y = _cifar_arrays([folder / n for n, _ in spec.test_list], label_key, num_classes)
    class_names = _class_names(folder / spec.meta["filename"], spec.meta["key"], num_classes)
    return SourceData(train_x, train_y, test_x, test_y, class_names)


def load_mnist_source(name: str, cfg: DataConfig) -> SourceData:
    """MNIST or Fashion-MNIST from ``<root>/<MNIST|FashionMNIST>/raw`` (the uncompressed idx files)."""
    spec = MNIST if name == "mnist" else FashionMNIST
    root = Path(cfg.root).expanduser()
    raw = root / spec.__name__ / "raw"
    files = ["train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"]
    if not all((raw / f).is_file() for f in files) and cfg.download:
        try:
            spec(str(root), train=True, download=True)
        except Exception as err:
            raise DataError(f"Could not download {name} into {raw} ({type(err).__name__}: {err}).") from None
    if not all((raw / f).is_file() for f in files):
        raise DataError(
            f"The {name} files are missing from {raw} (expected {', '.join(files)}, the official archives "
            "uncompressed). Run with data.download=true (needs network) or copy them there."
        )
    train_x, train_y = read_image_file(str(raw / files[0])), read_label_file(str(raw / files[1]))
    test_x, test_y = read_image_file(str(raw / files[2])), read_label_file(str(raw / files[3]))
    return SourceData(train_x[:, None], train_y.long(), test_x[:, None], test_y.long(), list(spec.classes))


def load_svhn_source(cfg: DataConfig) -> SourceData:
    """SVHN (cropped digits) from ``<root>/svhn/{train,test}_32x32.mat``; label 10 means digit 0."""
    from scipy.io import loadmat

    folder = Path(cfg.root).expanduser() / "svhn"
    out = []
    for split in ("train", "test"):
        url, filename, md5 = SVHN.split_list[split]
        path = folder / filename
        if not path.is_file() and cfg.download:
            try:
                download_url(url, str(folder), filename, md5 if cfg.verify_checksums else None)
            except Exception as err:
                raise DataError(f"Could not download SVHN {split} from {url} ({type(err).__name__}: {err}).") from None
        if not path.is_file() or (cfg.verify_checksums and not check_integrity(str(path), md5)):
            raise DataError(
                f"SVHN's {path} is missing or fails its checksum. Run with data.download=true (needs network) or copy "
                f"{url} there"
                + ("; data.verify_checksums=false accepts a copy you made yourself." if cfg.verify_checksums else ".")
            )
        mat = loadmat(str(path))
        x = torch.from_numpy(np.ascontiguousarray(mat["X"].transpose(3, 2, 0, 1), dtype=np.uint8))
        out += [x, torch.from_numpy(mat["y"].astype(np.int64).reshape(-1) % 10)]
    return SourceData(*out, [str(d) for d in range(10)])


@dataclass(frozen=True)
class TorchvisionSet:
    """A dataset torchvision reads in its official layout: the reader, its training and test splits, and the layout
    (for the error when files are missing)."""

    reader: str  # the class in torchvision.datasets
    train_splits: tuple[str, ...]
    layout: str


TORCHVISION_SETS = {
    "gtsrb": TorchvisionSet(
        "GTSRB",
        ("train",),
        "gtsrb/GTSRB/Training/<class>/*.ppm, gtsrb/GTSRB/Final_Test/Images/*.ppm, gtsrb/GT-final_test.csv",
    ),
    "flowers102": TorchvisionSet(  # Piggyback and PackNet train on train + val (2,040 images), test on 6,149
        "Flowers102",
        ("train", "val"),
        "flowers-102/jpg/image_*.jpg, flowers-102/imagelabels.mat, flowers-102/setid.mat",
    ),
    "stanford_cars": TorchvisionSet(
        "StanfordCars",
        ("train",),
        "stanford_cars/{cars_train,cars_test}/*.jpg, stanford_cars/devkit/{cars_meta,cars_train_annos}.mat, "
        "stanford_cars/cars_test_annos_withlabels.mat",
    ),
}


def _torchvision_reader(name: str, verify: bool) -> type:
    """The torchvision class; with ``data.verify_checksums=false`` a copy made by hand is accepted where torchvision
    checks MD5s before reading (Flowers102's .mat files)."""
    import torchvision.datasets

    reader = getattr(torchvision.datasets, TORCHVISION_SETS[name].reader)
    if verify or not hasattr(reader, "_check_integrity"):
        return reader
    return type(
        f"Unverified{reader.__name__}", (reader,), {"_check_integrity": lambda self: self._images_folder.is_dir()}
    )


def dataset_targets(dataset: Any) -> list[int]:
    """The labels of a torchvision dataset without decoding its images (each reader keeps them its own way)."""
    if hasattr(dataset, "_samples"):  # GTSRB, StanfordCars
        return [int(target) for _, target in dataset._samples]
    if hasattr(dataset, "_labels"):  # Flowers102
        return [int(target) for target in dataset._labels]
    return [int(target) for target in dataset.targets]  # ImageFolder-based readers


def load_torchvision_source(name: str, cfg: DataConfig) -> SourceData:
    """A :data:`TORCHVISION_SETS` dataset through torchvision's own reader; its images (of any size) are decoded on
    demand, in ``data.decode_workers`` threads, straight to ``data.store_size`` squares."""
    from torchvision.transforms import v2

    spec, size = TORCHVISION_SETS[name], cfg.store_size
    assert size is not None  # checked by DataConfig (sequences and these sources need it)
    decode = v2.Compose([v2.PILToTensor(), v2.Resize(size, antialias=True), v2.CenterCrop(size)])
    reader = _torchvision_reader(name, cfg.verify_checksums)
    out, classes = [], None
    for splits in (spec.train_splits, ("test",)):
        datasets = []
        for split in splits:
            try:
                datasets.append(reader(cfg.root, split=split, transform=decode, download=cfg.download))
            except Exception as err:  # missing files (RuntimeError), failed checksums or downloads
                raise DataError(
                    f"{name}'s {split} split cannot be read under {Path(cfg.root).expanduser()} "
                    f"({type(err).__name__}: {err}). Expected its official layout: {spec.layout}, or an image "
                    f"folder {name}/{{train,test}}/<class>/*"
                    + (" (data.download=true fetches it)." if not cfg.download else ".")
                ) from None
            classes = classes or getattr(datasets[-1], "classes", None)
        joined = ConcatDataset(datasets)  # train + val for Flowers-102
        if not len(joined):
            raise DataError(f"{name}'s {'/'.join(splits)} split under {cfg.root} holds no images.")
        out += [LazyImages(len(joined), size, cfg.decode_workers, lambda i, joined=joined: joined[i][0])]
        out += [torch.tensor([t for d in datasets for t in dataset_targets(d)], dtype=torch.long)]
    num_classes = int(max(out[1].max(), out[3].max())) + 1
    return SourceData(*out, list(classes or [f"{name}_{i}" for i in range(num_classes)]))


def load_cub200_source(cfg: DataConfig) -> SourceData:
    """CUB-200-2011 in its official layout, with its official train/test split (5,994 / 5,794 images):
    ``<root>/CUB_200_2011/{images.txt, image_class_labels.txt, train_test_split.txt, classes.txt}`` and
    ``images/<class>/*.jpg``. Whole images, centre-cropped and stored at ``data.store_size`` (no bounding-box crop)."""
    assert cfg.store_size is not None  # checked by DataConfig
    base = Path(cfg.root).expanduser() / "CUB_200_2011"
    lists = ("images.txt", "image_class_labels.txt", "train_test_split.txt", "classes.txt")
    missing = [n for n in lists if not (base / n).is_file()] + ([] if (base / "images").is_dir() else ["images/"])
    if missing:
        raise DataError(
            f"CUB-200-2011 is incomplete under {base}: {', '.join(missing)} missing. Extract the official "
            "CUB_200_2011.tgz into data.root (images.txt, image_class_labels.txt, train_test_split.txt, classes.txt "
            "and images/<class>/*.jpg), or give an image folder cub200/{train,test}/<class>/*."
        )

    def table(name: str) -> dict[str, str]:
        try:
            return dict(line.split(maxsplit=1) for line in (base / name).read_text().splitlines() if line.strip())
        except ValueError:
            raise DataError(f"{base / name} is malformed: each line must be '<id> <value>'.") from None

    paths, labels, train, names = (table(n) for n in lists)
    ids = sorted(paths, key=int)
    try:
        parts = {flag: [i for i in ids if train[i].strip() == flag] for flag in ("1", "0")}
        out = []
        for flag in ("1", "0"):
            files = [base / "images" / paths[i].strip() for i in parts[flag]]
            out += [load_images(files, cfg.store_size, cfg.decode_workers, short_side=cfg.transforms == "pilot")]
            out += [torch.tensor([int(labels[i]) - 1 for i in parts[flag]], dtype=torch.long)]
    except KeyError as err:
        raise DataError(
            f"CUB-200-2011 under {base}: image id {err} is missing from one of {', '.join(lists)}."
        ) from None
    return SourceData(*out, [names[k].strip() for k in sorted(names, key=int)])


def own_split(folder: Path) -> tuple[Path, Path] | None:
    """The (train, test) sub-folders of a dataset that ships its own split: ``train`` and ``test``, or ``train`` and
    ``val`` (ImageNet's layout, whose validation set is the test set of SplitImageNet and most CL papers)."""
    test = next((folder / n for n in ("test", "val") if (folder / n).is_dir()), None)
    return (folder / "train", test) if test is not None and (folder / "train").is_dir() else None


def load_image_folder_source(folder_name: str, cfg: DataConfig) -> SourceData:
    """An image-folder dataset with its own train/test split, split by fixed lists (``data.split_lists``), or split
    per class with ``data.split_seed`` (``data.folder_split`` says which it must be). Either way the split is
    recorded: the classes, counts and SHA-256 of the file list (what identifies a split archive's copy), the lists'
    SHA-256, or the seed and the test files' SHA-256."""
    folder = Path(cfg.root).expanduser() / folder_name
    if not folder.is_dir():
        raise DataError(
            f"The image folder {folder} does not exist. Expected {folder}/train/<class>/* and {folder}/test/<class>/* "
            f"(or {folder}/val/<class>/*), "
            f"or {folder}/<class>/* (then split with data.split_seed); point data.root at the folder holding "
            f"{folder_name}/."
        )
    assert cfg.store_size is not None  # checked by DataConfig
    own = own_split(folder)
    if own is None and cfg.folder_split == "own":
        raise DataError(
            f"The image folder {folder} has no train/ and test/ sub-folders, and data.folder_split=own reads a split "
            f"archive's own split: expected {folder}/train/<class>/* and {folder}/test/<class>/*."
        )
    if own is not None and cfg.folder_split in ("seeded", "lists"):
        how = "by data.split_seed" if cfg.folder_split == "seeded" else f"by the lists {cfg.split_lists}"
        raise DataError(
            f"The image folder {folder} holds {own[0].name}/ and {own[1].name}/ (a split archive's own split), and "
            f"data.folder_split={cfg.folder_split} splits {folder}/<class>/* {how}: another realisation of the "
            "benchmark. Keep the two under different data.root folders."
        )
    if own:
        split = own_split_files(folder, own)
    elif cfg.folder_split == "lists":
        split = listed_split_files(folder, cfg)
    else:
        split = seeded_split_files(folder, cfg)
    if not split.train_files or not split.test_files:
        raise DataError(f"{folder} holds no training or no test images (suffixes: jpg, jpeg, png, bmp, ...).")
    pilot = cfg.transforms == "pilot"  # the square PILOT's test path crops from
    train_x = load_images(split.train_files, cfg.store_size, cfg.decode_workers, short_side=pilot)
    test_x = load_images(split.test_files, cfg.store_size, cfg.decode_workers, short_side=pilot)
    counts = {"train_images": len(split.train_files), "test_images": len(split.test_files)}
    record = {"folder": folder_name, **split.record, **counts}
    train_y, test_y = torch.from_numpy(split.train_y), torch.from_numpy(split.test_y)
    return SourceData(train_x, train_y, test_x, test_y, split.classes, record)


class FolderSplit(NamedTuple):
    """An image folder's split: its files and labels, its class names, and what results.json records of it."""

    train_files: list[Path]
    train_y: np.ndarray
    test_files: list[Path]
    test_y: np.ndarray
    classes: list[str]
    record: dict[str, Any]


def own_split_files(folder: Path, own: tuple[Path, Path]) -> FolderSplit:
    """A split archive's ``train/`` and ``test/`` folders, labelled by the sorted class folder names."""
    classes = same_classes(*own)
    train_files, train_y = list_images(own[0], classes)
    test_files, test_y = list_images(own[1], classes)
    require_every_class(own, classes, train_y, test_y)
    record = {
        "split": f"{own[0].name}/ and {own[1].name}/",
        "classes": len(classes),
        "files_sha256": split_digest(train_files + test_files, folder),
    }
    return FolderSplit(train_files, train_y, test_files, test_y, classes, record)


def listed_split_files(folder: Path, cfg: DataConfig) -> FolderSplit:
    """The images ``data.split_lists`` names, labelled by the lists' own class order."""
    assert cfg.split_lists is not None  # checked by DataConfig
    lists = read_split_lists(cfg.split_lists)
    require_listed_files(folder, lists)
    train_files, test_files = [folder / p for p in lists.train], [folder / p for p in lists.test]
    record = {"split": f"lists {lists.name}", "lists_sha256": lists.sha256, "classes": len(lists.classes)}
    train_y, test_y = lists.labels(lists.train), lists.labels(lists.test)
    return FolderSplit(train_files, train_y, test_files, test_y, lists.classes, record)


def seeded_split_files(folder: Path, cfg: DataConfig) -> FolderSplit:
    """``<class>/*`` split per class, ``test_fraction`` of each class's images drawn by ``split_seed``."""
    classes = list_classes(folder)
    files, labels = list_images(folder, classes)
    test = seeded_split(labels, cfg.test_fraction, cfg.split_seed)
    train_files = [f for f, t in zip(files, test, strict=True) if not t]
    test_files = [f for f, t in zip(files, test, strict=True) if t]
    record = {
        "seed": cfg.split_seed,
        "test_fraction": cfg.test_fraction,
        "test_files_sha256": split_digest(test_files, folder),
    }
    return FolderSplit(train_files, labels[~test], test_files, labels[test], classes, record)


def same_classes(train: Path, test: Path) -> list[str]:
    """The class folders of a split, the same in both halves: a class is its position among the sorted folder names
    of each half (torchvision's ImageFolder), so a folder only one half has would shift every label after it."""
    classes, other = list_classes(train), list_classes(test)
    if classes != other:
        only = [f"only in {half}: {', '.join(sorted(set(a) - set(b))[:8])}" for half, a, b in
                ((train, classes, other), (test, other, classes)) if set(a) - set(b)]  # fmt: skip
        raise DataError(
            f"{train} and {test} do not hold the same class folders ({len(classes)} and {len(other)}; "
            f"{'; '.join(only)}). A split archive's two halves list the same classes: extract it again."
        )
    return classes


def require_every_class(halves: tuple[Path, Path], classes: list[str], *labels: np.ndarray) -> None:
    """Each class folder of each half holds an image (torchvision's ImageFolder refuses one that does not)."""
    for half, y in zip(halves, labels, strict=True):
        empty = [classes[c] for c in sorted(set(range(len(classes))) - set(y.tolist()))]
        if empty:
            raise DataError(
                f"{len(empty)} class folder(s) of {half} hold no image ({', '.join(empty[:8])}): every class of a "
                "split needs training and test images (suffixes: jpg, jpeg, png, bmp, ...)."
            )


BUILT_IN: dict[str, Callable[[DataConfig], SourceData]] = {
    "digits": lambda cfg: load_digits_source(),
    "synthetic": load_synthetic_source,
    "cifar10": lambda cfg: load_cifar_source(cfg, "cifar10"),
    "cifar100": lambda cfg: load_cifar_source(cfg, "cifar100"),
    "mnist": lambda cfg: load_mnist_source("mnist", cfg),
    "fashion_mnist": lambda cfg: load_mnist_source("fashion_mnist", cfg),
    "svhn": load_svhn_source,
    **{name: lambda cfg, name=name: load_torchvision_source(name, cfg) for name in TORCHVISION_SETS},
    "cub200": load_cub200_source,
}


# Where each built-in source's files are, under data.root: what the on-disk cache fingerprints.
SOURCE_FOLDERS = {
    "cifar10": CIFAR10.base_folder,
    "cifar100": CIFAR100.base_folder,
    "mnist": "MNIST/raw",
    "fashion_mnist": "FashionMNIST/raw",
    "svhn": "svhn",
    "gtsrb": "gtsrb",
    "flowers102": "flowers-102",
    "stanford_cars": "stanford_cars",
    "cub200": "CUB_200_2011",
}


def reads_folder(name: str, cfg: DataConfig) -> bool:
    """Whether ``name`` is read as an image folder ``<root>/<name>``: one with its own split takes precedence over a
    built-in reader (e.g. Piggyback's cropped copies of CUB-200 or Stanford Cars); a name that is no built-in is one."""
    return name not in BUILT_IN or own_split(Path(cfg.root).expanduser() / name) is not None


def source_folder(name: str, cfg: DataConfig) -> Path | None:
    """The folder holding the files source ``name`` is read from (None: digits and synthetic, made without files)."""
    root = Path(cfg.root).expanduser()
    if reads_folder(name, cfg):
        return root / name
    return root / SOURCE_FOLDERS[name] if name in SOURCE_FOLDERS else None


def load_named_source(name: str, cfg: DataConfig) -> SourceData:
    """A dataset by name: an image folder ``<root>/<name>`` where :func:`reads_folder` says so, else the built-in
    reader of that name (the dataset's official layout)."""
    return load_image_folder_source(name, cfg) if reads_folder(name, cfg) else BUILT_IN[name](cfg)
