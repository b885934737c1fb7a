"""No silent wrong numbers (issue 24's fault round): the image cache is checked against its build's checksums, labels
and metadata, a source rewritten in place gets a new cache, a cache deleted mid-run is a clean error, the shipped
weights are checked against their known hash, and the config refuses what could only end in empty or undefined
numbers."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from clbench.backbones import build_backbone, timm_vit
from clbench.config import validate
from clbench.data import build_benchmark, checksums
from clbench.data.cache import cache_key
from clbench.data.stream import _array
from clbench.errors import ClbenchError, ConfigError, DataError, Interrupted, WeightsError
from conftest import TINY, clbench, compose_config, run_command, tiny_config
from test_stream import reader_workers, stream_config


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    from test_folders import write_image_folder

    write_image_folder(tmp_path / "ds", [f"c{i}" for i in range(4)], 6, split=True)
    return tmp_path


def built(folder: Path, **kw) -> Path:
    """The cache folder of the test image folder, built."""
    return Path(build_benchmark(stream_config(folder, store="stream", **kw)).train[0].x.files[0]).parent


def reverse(path: Path) -> None:
    np.save(path, np.load(path)[::-1].copy())


def flip_a_bit(path: Path) -> None:
    with path.open("r+b") as f:
        f.seek(path.stat().st_size - 7)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x04]))


def zero(path: Path) -> None:
    np.save(path, np.zeros_like(np.load(path)))


def invert(path: Path) -> None:
    np.save(path, 255 - np.load(path))


@pytest.mark.parametrize(
    ("array", "damage"),
    [("test_y", reverse), ("train_x", flip_a_bit), ("train_x", zero), ("train_x", invert)],
    ids=["reversed labels", "a flipped bit", "zeroed pixels", "inverted pixels"],
)
def test_an_array_damaged_in_place_is_refused(folder: Path, array: str, damage) -> None:
    cache = built(folder)
    damage(cache / f"{array}.npy")
    with pytest.raises(DataError, match=rf"image cache .* is damaged: {array}\.npy is not what was stored.*Delete"):
        built(folder)
    built(folder, verify_checksums=False)  # the documented opt-out reads it as it is


def test_unchanged_arrays_are_not_hashed_again_and_a_changed_one_is(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The build's stamp covers the files it wrote (a renamed folder keeps their ctimes): opening hashes nothing;
    after a write to one array (same bytes), that file alone is hashed again, and passes."""
    cache = built(folder)
    hashed: list[str] = []
    real = checksums.digests
    monkeypatch.setattr(
        checksums, "digests", lambda paths, threads: hashed.extend(p.name for p in paths) or real(paths, threads)
    )
    built(folder)
    assert hashed == []
    path = cache / "test_x.npy"
    path.write_bytes(path.read_bytes())
    built(folder)
    assert hashed == ["test_x.npy"]
    built(folder)
    assert hashed == ["test_x.npy"]  # stamped again


@pytest.mark.parametrize(
    ("what", "message"),
    [
        ("label 999", "train_y hold labels outside the 4 classes"),
        ("float labels", "test_y not of the recorded shape and type"),
        ("no class names", "meta.json has no class_names"),
    ],
)
def test_damaged_values_and_metadata_are_refused_as_damaged(folder: Path, what: str, message: str) -> None:
    cache = built(folder)
    if what == "label 999":
        labels = np.load(cache / "train_y.npy")
        labels[0] = 999
        np.save(cache / "train_y.npy", labels)
    elif what == "float labels":
        np.save(cache / "test_y.npy", np.load(cache / "test_y.npy").astype(np.float64))
    else:
        meta = json.loads((cache / "meta.json").read_text())
        del meta["class_names"]
        (cache / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(DataError, match=rf"is damaged \(ValueError: {message}\)\. Delete that folder"):
        built(folder, verify_checksums=False)  # found without the checksums


def test_a_source_rewritten_in_place_with_its_mtime_restored_gets_a_new_cache(folder: Path) -> None:
    """Rewritten and given its old modification time back (os.utime): its status-change time still moves."""
    cfg = stream_config(folder, store="stream")
    before = cache_key("ds", cfg, None)
    image = next((folder / "ds" / "train").rglob("*.png"))
    stat = image.stat()
    image.write_bytes(image.read_bytes())
    os.utime(image, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert image.stat().st_mtime_ns == stat.st_mtime_ns and image.stat().st_size == stat.st_size
    assert cache_key("ds", cfg, None)["files"] != before["files"]


def test_a_cache_deleted_while_it_is_read_is_a_data_error_and_the_workers_stop(folder: Path) -> None:
    for workers in (0, 2):
        split = build_benchmark(stream_config(folder, store="stream", stream_workers=workers)).train[0]
        shutil.rmtree(Path(split.x.files[0]).parent)
        _array.cache_clear()  # this process has not mapped the files yet
        with pytest.raises(DataError, match=r"image cache file .*train_x\.npy cannot be read .*resume=true"):
            list(split.batches(2, order=torch.arange(len(split))))
        assert reader_workers() == []  # shut down, not left to the exit


def test_a_run_stopped_by_an_error_outside_the_reader_exits_without_waiting_for_its_workers(folder: Path) -> None:
    """The workers ignore the first SIGTERM (a job's signal goes to them too); multiprocessing's exit handler
    terminates and joins them: without clbench's own shutdown first, the process would wait forever."""
    script = f"""
import torch
from pathlib import Path
from clbench.data import build_benchmark
from test_stream import stream_config
split = build_benchmark(stream_config(Path({str(folder)!r}), store="stream", stream_workers=2)).train[0]
batches = split.batches(2, order=torch.arange(len(split)))
next(batches)
raise SystemExit(3)  # as a stop signal or a failed step leaves the loop: the epoch's reader still open
"""
    out = run_command(sys.executable, "-c", script, cwd=Path(__file__).parent)  # a wait forever: run_command's limit
    assert out.returncode == 3, out.stderr[-2000:]


def test_a_run_whose_cache_is_deleted_mid_task_fails_in_one_paragraph(tmp_path: Path) -> None:
    script = f"""
import shutil, sys
from pathlib import Path
import clbench.checkpoint as ckpt
from clbench.data.stream import _array
real = ckpt.save
def save(*a, **k):
    real(*a, **k)
    shutil.rmtree({str(tmp_path / "cache")!r}, ignore_errors=True)
    _array.cache_clear()
ckpt.save = save
sys.argv = ["clbench", *{[*TINY, "data.store=stream", "data.stream_workers=2"]!r},
            "data.cache_dir={tmp_path / "cache"}", "hydra.run.dir={tmp_path / "run"}"]
from clbench.cli import main
main()
"""
    out = run_command(sys.executable, "-c", script, cwd=tmp_path)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert "cannot be read" in out.stderr and "resume=true" in out.stderr
    assert json.loads((tmp_path / "run" / "results.json").read_text())["status"] == "failed"


def test_the_shipped_weights_damaged_in_place_are_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """XOR 0x40 into one byte of every float of a copy of the shipped file: its SHA-256 is not the shipped one."""
    copy = tmp_path / "vit_micro.glyphs.safetensors"
    data = bytearray((timm_vit.WEIGHTS_DIR / copy.name).read_bytes())
    header = 8 + int.from_bytes(data[:8], "little")
    for i in range(header + 2, len(data), 4):
        data[i] ^= 0x40
    copy.write_bytes(bytes(data))
    monkeypatch.setattr(timm_vit, "WEIGHTS_DIR", tmp_path)
    with pytest.raises(WeightsError, match=r"shipped weights file .* is damaged.*make weights"):
        build_backbone(validate(compose_config()).backbone)


def test_kwargs_that_build_no_model_are_the_configs_error_even_with_a_weights_file() -> None:
    with pytest.raises(ConfigError, match=r"backbone\.kwargs.*do not build"):
        build_backbone(validate(compose_config("backbone.kwargs.embed_dim=62")).backbone)


def test_a_stop_signal_while_the_method_is_imported_is_not_called_an_import_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from clbench import config

    def interrupted(_target: str) -> None:
        raise Interrupted("stopped by SIGINT outside training")

    monkeypatch.setattr(config, "get_class", interrupted)
    with pytest.raises(Interrupted):
        tiny_config()


def test_a_validation_split_that_holds_nothing_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"data\.val_fraction.*holds out no image of task 0"):
        build_benchmark(
            validate(compose_config(*TINY, "data.synthetic_train_per_class=1", "data.val_fraction=0.1")).data
        )


@pytest.mark.parametrize(
    ("objective", "why"),
    [
        ("validation.til.fwt", "FWT is not"),
        ("validation.cil.bwt data.num_tasks=1", "needs two tasks or more"),
        ("til.forgetting objective_on_test=true data.num_tasks=1", "needs two tasks or more"),
    ],
)
def test_an_objective_that_can_never_have_a_value_is_refused(objective: str, why: str) -> None:
    name, *more = objective.split()
    with pytest.raises(ClbenchError, match=why):
        tiny_config(f"objective={name}", "data.val_fraction=0.2", *more)


def test_resume_accepts_where_the_data_lives_and_how_it_is_read(tmp_path: Path) -> None:
    """A run started from the device store resumes streamed from another cache folder (and a validation seed without
    a validation split): settings that do not change the results, said at the start."""
    from test_resume import CHECKPOINTED, matrices

    run = (*TINY, *CHECKPOINTED, "data.val_fraction=0", "logger.mode=disabled")
    whole = clbench(*run, f"hydra.run.dir={tmp_path / 'whole'}", cwd=tmp_path)
    assert whole.returncode == 0, whole.stderr[-2000:]
    from test_resume import clbench_killing_itself

    killed = clbench_killing_itself(tmp_path / "resumed", "KILL", 3, *run)
    assert killed.returncode == -9
    moved = ("data.store=stream", f"data.cache_dir={tmp_path / 'cache'}", "data.val_seed=5", "data.root=elsewhere")
    resumed = clbench(*run, *moved, "resume=true", f"hydra.run.dir={tmp_path / 'resumed'}", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    said = " ".join(resumed.stderr.split())
    assert "data.store: 'device' -> 'stream'" in said and "data.val_seed: 0 -> 5" in said
    assert matrices(tmp_path / "resumed" / "results.json") == matrices(tmp_path / "whole" / "results.json")
