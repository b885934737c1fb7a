"""Fixed train/test file lists over an image folder (``data.folder_split=lists``): a split that a repository ships as
lists, read exactly rather than drawn again.

A lists file is JSON (gzipped where its name ends in ``.gz``)::

    {"name": ..., "source": "where the lists come from", "folder": "imagenet-r",
     "classes": ["n02165456", ...],                 # label i is classes[i]
     "train": ["n02128757/sculpture_4.jpg", ...],   # paths under <data.root>/<folder>, <class>/<file>
     "test": [...]}

An image's class is its path's first component, its label that class's position in ``classes`` (the repository's label
ids, which need not be the sorted folder order). ``data.split_lists`` names a file shipped with clbench
(:data:`SHIPPED`) or the path of one's own.
"""

from __future__ import annotations

import gzip
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from clbench.errors import DataError

SHIPPED = Path(__file__).parent / "splits"  # <name>.json.gz, one per realisation clbench ships


@dataclass(frozen=True)
class SplitLists:
    name: str
    source: str
    folder: str
    classes: list[str]
    train: list[str]
    test: list[str]
    sha256: str  # of the file's bytes: what results.json and the image cache record

    def labels(self, paths: list[str]) -> np.ndarray:
        index = {name: i for i, name in enumerate(self.classes)}
        return np.asarray([index[p.split("/", 1)[0]] for p in paths], dtype=np.int64)


def shipped_names() -> list[str]:
    return sorted(p.name.removesuffix(".json.gz") for p in SHIPPED.glob("*.json.gz"))


def lists_path(spec: str) -> Path:
    """The file ``data.split_lists`` names: a shipped realisation by name, else a path."""
    if "/" not in spec and not spec.endswith((".json", ".gz")):
        path = SHIPPED / f"{spec}.json.gz"
        if not path.is_file():
            raise DataError(
                f"data.split_lists={spec!r} is no split shipped with clbench ({', '.join(shipped_names())}); "
                "name one of these or the path of a lists file (.json or .json.gz)."
            )
        return path
    path = Path(spec).expanduser()
    if not path.is_file():
        raise DataError(f"The split lists file {path} (data.split_lists) does not exist.")
    return path


def lists_digest(spec: str) -> str:
    """SHA-256 of the lists file's bytes."""
    return hashlib.sha256(lists_path(spec).read_bytes()).hexdigest()


def read_split_lists(spec: str) -> SplitLists:
    """The lists ``spec`` names, checked: every path ``<class>/<file>`` of a listed class, no image in both halves."""
    path = lists_path(spec)
    raw = path.read_bytes()
    try:
        entries = json.loads(gzip.decompress(raw) if path.suffix == ".gz" else raw)
        lists = SplitLists(
            name=str(entries.get("name", path.name)),
            source=str(entries.get("source", "")),
            folder=str(entries["folder"]),
            classes=[str(c) for c in entries["classes"]],
            train=[str(p) for p in entries["train"]],
            test=[str(p) for p in entries["test"]],
            sha256=hashlib.sha256(raw).hexdigest(),
        )
    except (OSError, EOFError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise DataError(
            f"The split lists file {path} is not a lists file ({type(err).__name__}: {err}): expected JSON with "
            '"folder", "classes", "train" and "test" (see clbench.data.split_lists).'
        ) from None
    problems = []
    if len(set(lists.classes)) != len(lists.classes):
        problems.append("a class is listed twice")
    known = set(lists.classes)
    stray = [p for p in lists.train + lists.test if p.count("/") < 1 or p.split("/", 1)[0] not in known]
    if stray:
        problems.append(f"{len(stray)} path(s) are not <class>/<file> of a listed class (e.g. {stray[0]!r})")
    both = set(lists.train) & set(lists.test)
    if both:
        problems.append(f"{len(both)} image(s) are in both train and test (e.g. {sorted(both)[0]!r})")
    if not lists.train or not lists.test:
        problems.append("the train or the test list is empty")
    if problems:
        raise DataError(f"The split lists file {path} is inconsistent: {'; '.join(problems)}.")
    return lists


def require_listed_files(folder: Path, lists: SplitLists) -> None:
    """Every listed image is a file under ``folder``; else one error naming how many are missing and some of them."""
    missing = [p for p in lists.train + lists.test if not (folder / p).is_file()]
    if missing:
        raise DataError(
            f"{len(missing)} of the {len(lists.train) + len(lists.test)} images that the split {lists.name} lists are "
            f"missing under {folder} (e.g. {', '.join(missing[:5])}). The lists name the dataset's own files, "
            f"{folder}/<class>/<file>, as its official archive extracts them ({lists.source})."
        )
