"""Protocol D's CODA-Prompt realisation: the ImageNet-R train/test lists that CODA-Prompt's repository ships, read
exactly (data.folder_split=lists), their label ids kept, and every way to get them wrong refused before any work."""

from __future__ import annotations

import gzip
import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from clbench.config import validate
from clbench.data import build_benchmark
from clbench.data.cache import cache_key
from clbench.data.split_lists import read_split_lists
from clbench.errors import ConfigError, DataError
from conftest import compose_config

# The lists of GT-RIPL/CODA-Prompt @ 6417d4f, dataloaders/splits/imagenet-r_{train,test}.yaml, as PTM spec §7.5 hashes
# them (SHA-256 of the sorted paths joined by newlines, first 16 hex) and counts them, and (path, label) pairs read off
# those files: the first two of each list.
CODA_SHA256_16 = {"train": "e6e7dd781bc26b94", "test": "c58cb462cef0d2b6"}
# ... and of every (path, label) pair of the yaml files: "<path> <target>" lines, sorted, newline-joined (computed from
# the files at that commit)
CODA_PAIRS_SHA256_16 = {"train": "011fd157c155cc1a", "test": "c1a5cb95288d56d9"}
CODA_COUNTS = {"train": 24000, "test": 6000}
CODA_PAIRS = {
    "train": [("n02128757/sculpture_4.jpg", 177), ("n02268443/misc_113.jpg", 142)],
    "test": [("n01910747/tattoo_75.jpg", 153), ("n02437616/painting_1.jpg", 76)],
}


def test_the_shipped_lists_are_coda_prompts_files() -> None:
    lists = read_split_lists("coda_imagenet_r")
    assert lists.folder == "imagenet-r" and len(lists.classes) == 200
    for half in ("train", "test"):
        paths = getattr(lists, half)
        assert len(paths) == CODA_COUNTS[half]
        joined = "\n".join(sorted(f"data/imagenet-r/{p}" for p in paths))  # the yaml's own spelling
        assert hashlib.sha256(joined.encode()).hexdigest()[:16] == CODA_SHA256_16[half]
        labels = lists.labels(paths)
        pairs = "\n".join(sorted(f"data/imagenet-r/{p} {y}" for p, y in zip(paths, labels.tolist(), strict=True)))
        assert hashlib.sha256(pairs.encode()).hexdigest()[:16] == CODA_PAIRS_SHA256_16[half]
        for path, label in CODA_PAIRS[half]:
            assert labels[paths.index(path)] == label
    assert not set(lists.train) & set(lists.test)


def write_folder(root: Path, names: dict[str, int]) -> None:
    """``<root>/imagenet-r/<wnid>/<file>`` as the official archive extracts it; each image's grey level codes its
    class (10 x the class folder's index in ``sorted(names)``)."""
    wnids = sorted({p.split("/")[0] for p in names})
    for path in names:
        (root / "imagenet-r" / path).parent.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (12, 9), (10 * wnids.index(path.split("/")[0]),) * 3).save(root / "imagenet-r" / path)


def write_lists(path: Path, classes: list[str], train: list[str], test: list[str]) -> Path:
    path.write_bytes(gzip.compress(json.dumps({"folder": "imagenet-r", "classes": classes, "train": train,
                                               "test": test}).encode()))  # fmt: skip
    return path


CLASSES = ["n3", "n0", "n2", "n1"]  # the lists' label order: not the sorted folder order
TRAIN = ["n0/a.png", "n0/b.png", "n1/a.png", "n1/b.png", "n2/a.png", "n2/b.png", "n3/a.png", "n3/b.png"]
TEST = ["n0/c.png", "n1/c.png", "n2/c.png", "n3/c.png"]


def lists_config(root: Path, lists: Path, *overrides: str):
    cfg = compose_config("data=imagenet_r_d_coda", f"data.root={root}", f"data.split_lists={lists}", "data.tasks=2",
                         "data.protocol=clbench", "data.store=device", *overrides)  # fmt: skip
    return validate(cfg).data


def test_a_folder_split_by_lists_holds_exactly_the_listed_images_with_the_lists_labels(tmp_path: Path) -> None:
    write_folder(tmp_path, dict.fromkeys([*TRAIN, *TEST, "n0/unlisted.png"], 0))
    lists = write_lists(tmp_path / "lists.json.gz", CLASSES, TRAIN, TEST)
    bench = build_benchmark(lists_config(tmp_path, lists))
    assert [list(t.class_names) for t in bench.tasks] == [CLASSES[:2], CLASSES[2:]]  # ids unshuffled, in the lists
    sorted_wnids = sorted(CLASSES)
    for split, per_class in ((bench.train, 2), (bench.test, 1)):
        for task, part in zip(bench.tasks, split, strict=True):
            wnids = [sorted_wnids[round(x.float().mean().item() / 10)] for x in part.x]  # each image's own folder
            assert sorted(wnids) == sorted(list(task.class_names) * per_class)  # no unlisted image
            assert [CLASSES[c] for c in part.y.tolist()] == wnids  # label = the wnid's place in the lists
    assert bench.splits[0]["split"] == "lists lists.json.gz" and bench.splits[0]["classes"] == 4
    assert bench.splits[0]["lists_sha256"] == hashlib.sha256(lists.read_bytes()).hexdigest()
    assert (bench.splits[0]["train_images"], bench.splits[0]["test_images"]) == (8, 4)


def test_missing_listed_images_are_counted_and_named(tmp_path: Path) -> None:
    write_folder(tmp_path, dict.fromkeys(TRAIN[1:] + TEST, 0))
    lists = write_lists(tmp_path / "lists.json.gz", CLASSES, TRAIN, TEST)
    with pytest.raises(DataError, match=r"1 of the 12 images .* missing under .*imagenet-r \(e\.g\. n0/a\.png\)"):
        build_benchmark(lists_config(tmp_path, lists))


@pytest.mark.parametrize(
    ("classes", "train", "test", "problem"),
    [
        (CLASSES, TRAIN, [*TEST, "n0/a.png"], r"1 image\(s\) are in both train and test"),
        (CLASSES[1:], TRAIN, TEST, r"3 path\(s\) are not <class>/<file> of a listed class \(e\.g\. 'n3/a\.png'\)"),
        ([*CLASSES, "n0"], TRAIN, TEST, "a class is listed twice"),
    ],
)
def test_inconsistent_lists_are_refused(
    tmp_path: Path, classes: list[str], train: list[str], test: list[str], problem: str
) -> None:
    lists = write_lists(tmp_path / "lists.json.gz", classes, train, test)
    with pytest.raises(DataError, match=f"is inconsistent: {problem}"):
        read_split_lists(str(lists))


def test_a_file_that_is_no_lists_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "bad.json").write_text('{"folder": "imagenet-r", "train": []}')
    with pytest.raises(DataError, match=r"bad\.json is not a lists file \(KeyError"):
        read_split_lists(str(tmp_path / "bad.json"))


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (("data.split_lists=null",), "data.split_lists"),  # lists to read
        (("data.folder_split=auto",), "data.split_lists"),  # lists without the lists split
        (("data.split_lists=coda_imagenet_rr",), "data.split_lists"),  # no such shipped split
        (("data.folder_split=lists", "data.split_lists=/no/such.json"), "data.split_lists"),
    ],
)
def test_the_lists_options_are_checked_before_any_work(overrides: tuple[str, ...], key: str) -> None:
    with pytest.raises(ConfigError, match=f"`{key}`"):
        validate(compose_config("data=imagenet_r_d_coda", *overrides))


def test_d_coda_means_codas_lists_and_an_archive_layout_is_refused(tmp_path: Path) -> None:
    lists = write_lists(tmp_path / "lists.json.gz", CLASSES, TRAIN, TEST)
    with pytest.raises(ConfigError, match=r"coda_imagenet_r with data\.protocol=D-coda"):
        validate(compose_config("data=imagenet_r_d_coda", f"data.split_lists={lists}"))
    for half in ("train", "test"):  # a split archive's layout: another realisation
        (tmp_path / "imagenet-r" / half / "n0").mkdir(parents=True)
    with pytest.raises(DataError, match=r"data\.folder_split=lists splits .* by the lists"):
        build_benchmark(lists_config(tmp_path, lists))


def test_the_image_cache_tells_two_lists_apart(tmp_path: Path) -> None:
    write_folder(tmp_path, dict.fromkeys(TRAIN + TEST, 0))
    one = write_lists(tmp_path / "one.json.gz", CLASSES, TRAIN, TEST)
    other = write_lists(tmp_path / "other.json.gz", CLASSES, TRAIN[1:], [*TEST, TRAIN[0]])
    keys = [cache_key("imagenet-r", lists_config(tmp_path, lists), None) for lists in (one, other)]
    assert keys[0] != keys[1] and np.all([k["files"] == keys[0]["files"] for k in keys])
