"""The streaming store (data.store=stream): the on-disk cache (built once, rebuilt when the source changes, safe under
concurrent builds, refused when damaged), batches identical to the device store's, a rank reading only its share, and
whole runs (single process, resumed mid-epoch, two gloo ranks) with the device store's accuracy matrices."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from clbench.config import DataConfig
from clbench.data import benchmark as benchmark_module
from clbench.data import build_benchmark
from clbench.data import sources as sources_module
from clbench.data.stream import DiskImages
from clbench.distributed import Ranks
from clbench.errors import ConfigError, DataError
from clbench.loop import step as step_module
from clbench.loop import train
from conftest import TINY, said, tiny_config, torchrun
from test_folders import folder_config, write_image_folder
from test_resume import matrices


def stream_config(root: Path, **kw) -> DataConfig:
    """A class split of a PNG image folder (own train/test split), cached under ``root/cache``."""
    return folder_config(root, cache_dir=str(root / "cache"), **kw)


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    write_image_folder(tmp_path / "ds", [f"c{i}" for i in range(4)], 6, split=True)
    return tmp_path


def epoch(split, seed: int, **kw) -> list[tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(seed)
    return list(split.batches(4, shuffle=True, **kw))


@pytest.mark.parametrize("workers", [0, 2])
def test_streamed_batches_are_the_device_stores(folder: Path, workers: int) -> None:
    held = build_benchmark(stream_config(folder))
    streamed = build_benchmark(stream_config(folder, store="stream", stream_workers=workers))
    assert isinstance(streamed.train[0].x, DiskImages) and isinstance(held.train[0].x, torch.Tensor)
    assert streamed.channels == held.channels == 3
    for a, b in zip([*held.train, *held.test], [*streamed.train, *streamed.test], strict=True):
        one, other = epoch(a, 0), epoch(b, 0)  # the same seed: the same permutation, the same pixels
        assert len(one) == len(other) == a.num_batches(4)
        for (xa, ya), (xb, yb) in zip(one, other, strict=True):
            assert torch.equal(xa, xb) and torch.equal(ya, yb)
        order = a.permutation()
        assert torch.equal(a.batch(order, 1, 4)[0], b.batch(order, 1, 4)[0])  # random access too
        resumed = list(b.batches(4, order=order, start=1))  # an epoch continued from its second batch
        assert [torch.equal(x, a.batch(order, i + 1, 4)[0]) for i, (x, _) in enumerate(resumed)] == [True] * len(
            resumed
        )


def test_a_rank_reads_only_its_share_of_each_batch(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    held = build_benchmark(stream_config(folder)).train[0]
    streamed = build_benchmark(stream_config(folder, store="stream", stream_workers=0)).train[0]  # read here
    read: list[int] = []
    real = DiskImages.read
    monkeypatch.setattr(DiskImages, "read", lambda self, rows: read.append(len(rows)) or real(self, rows))
    full, share = epoch(held, 3), epoch(streamed, 3, rows=Ranks(1, 4).rows())
    assert read == [1] * len(full)  # batches of 4 over 4 ranks: rank 1 reads one image of each
    for (x, _), (part, _) in zip(full, share, strict=True):
        assert torch.equal(part[1], x[1]) and not part[:1].any() and not part[2:].any()  # zeros: never read
    read.clear()
    epoch(streamed, 3, rows=Ranks(1, 4).rows(mirrored=True))  # mixup pairs row i with row n - 1 - i
    assert read == [2] * len(full)
    assert list(Ranks(1, 4).rows(mirrored=True)(4)) == [1, 2] and list(Ranks(0, 2).rows()(5)) == [0, 1, 2]
    assert Ranks().rows() is None  # one process reads every row


def test_the_cache_is_built_once_and_again_when_the_source_changes(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    loads: list[str] = []
    real = sources_module.load_image_folder_source
    monkeypatch.setattr(sources_module, "load_image_folder_source", lambda *a: loads.append(a[0]) or real(*a))
    cfg = stream_config(folder, store="stream")
    first = build_benchmark(cfg)
    again = build_benchmark(cfg)
    assert loads == ["ds"]  # decoded once; the second run reads the cache
    assert first.train[0].x.files == again.train[0].x.files
    (folder / "ds" / "train" / "c0" / "1.png").unlink()  # the source changes: a new cache, built anew
    changed = build_benchmark(cfg)
    assert loads == ["ds", "ds"] and changed.train[0].x.files != first.train[0].x.files
    assert sum(len(s) for s in changed.train) == sum(len(s) for s in first.train) - 1
    other = build_benchmark(stream_config(folder, store="stream", store_size=8))  # another storage resolution
    assert other.train[0].x.image_shape == (3, 8, 8) and len(loads) == 3


def test_the_cache_key_sees_linked_folders_empty_classes_and_the_decoders(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from clbench.data import cache

    cfg = stream_config(folder, store="stream")
    (folder / "ds").rename(folder / "real")
    (folder / "ds").symlink_to(folder / "real")  # a dataset linked in from a shared file system
    first = cache.cache_key("ds", cfg, None)
    assert first["files"] != cache.file_list_digest(folder / "missing")  # the files behind the link are listed
    (folder / "real" / "train" / "c0" / "0.png").touch()  # changed behind the link
    assert cache.cache_key("ds", cfg, None) != first
    second = cache.cache_key("ds", cfg, None)
    (folder / "real" / "train" / "b").mkdir()  # an empty class folder shifts the labels after it
    (folder / "real" / "test" / "b").mkdir()
    assert cache.cache_key("ds", cfg, None) != second
    third = cache.cache_key("ds", cfg, None)
    monkeypatch.setattr(cache.PIL, "__version__", "0.0")  # another Pillow may resize differently
    assert cache.cache_key("ds", cfg, None) != third


def test_a_cache_that_cannot_fit_is_refused_before_decoding(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from clbench.data import cache

    monkeypatch.setattr(cache.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 10**9 - 100, 100))
    with pytest.raises(DataError, match=r"needs 0\.0 GiB, but .* has 0\.0 GiB free"):
        build_benchmark(stream_config(folder, store="stream"))
    assert not [p for p in (folder / "cache").glob("ds-*") if p.is_dir()]  # nothing half-built left


def test_two_jobs_building_the_same_cache_at_once_build_it_once(folder: Path) -> None:
    script = f"""
from clbench.data import build_benchmark
from test_stream import stream_config
from pathlib import Path
bench = build_benchmark(stream_config(Path({str(folder)!r}), store="stream"))
print("images", sum(len(s) for s in bench.train))
"""
    env = {"PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    procs = [
        subprocess.Popen([sys.executable, "-c", script], env={**os.environ, **env}, stdout=-1, stderr=-1, text=True)
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert sum(out.count("decoding ds once") for out, _ in outs) == 1  # one job built it, the other waited
    assert all("images 20" in out for out, _ in outs)
    assert [p.name for p in (folder / "cache").iterdir() if p.is_dir()] == [
        p.name for p in (folder / "cache").glob("ds-*") if p.is_dir()
    ]  # no partial folder left


def test_a_killed_build_is_redone_and_a_damaged_cache_refused(folder: Path) -> None:
    cfg = stream_config(folder, store="stream")
    cache = build_benchmark(cfg).train[0].x.files[0]
    built = Path(cache).parent
    partial = built.with_name(built.name + ".partial-otherhost-1-0")
    built.rename(partial)  # as a build killed before its last step leaves it
    (partial / "meta.json").unlink()
    built.mkdir()  # and a folder whose removal was interrupted: no meta.json
    (built / "train_x.npy").write_bytes(b"half")
    again = build_benchmark(cfg)
    assert Path(again.train[0].x.files[0]).parent == built and not partial.exists()
    lock = built.with_name(built.name + ".lock")
    lock.unlink()
    build_benchmark(cfg)
    assert not lock.exists()  # a complete cache is opened without its lock: a read-only shared cache works
    with open(built / "train_x.npy", "r+b") as f:  # truncated
        f.truncate(200)
    with pytest.raises(DataError, match=r"image cache .* is damaged.*Delete that folder"):
        build_benchmark(cfg)


def test_auto_streams_only_what_does_not_fit(folder: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    held = build_benchmark(stream_config(folder, store="auto"))
    assert isinstance(held.train[0].x, torch.Tensor)
    assert "held on the device" in capsys.readouterr().out
    monkeypatch.setattr(benchmark_module, "free_memory", lambda device: 1000)
    streamed = build_benchmark(stream_config(folder, store="auto", val_fraction=0.5))
    assert isinstance(streamed.train[0].x, DiskImages) and len(streamed.validation[0]) > 0
    assert "streamed from the on-disk cache" in capsys.readouterr().out
    assert torch.equal(epoch(held.test[1], 0)[0][0], epoch(streamed.test[1], 0)[0][0])


STREAM = ("data.store=stream", "data.stream_workers=2", "data.val_fraction=0.2", "trainer.checkpoint_every=1")


def test_a_streamed_run_and_its_resume_match_the_device_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = f"data.cache_dir={tmp_path / 'cache'}"
    overrides = ("method=meat", *STREAM[2:])
    train(tiny_config(*overrides), tmp_path / "device")
    expected = matrices(tmp_path / "device" / "results.json")
    train(tiny_config(*overrides, *STREAM[:2], cache), tmp_path / "stream")
    assert matrices(tmp_path / "stream" / "results.json") == expected
    assert json.loads((tmp_path / "stream" / "results.json").read_text())["config"]["data"]["store"] == "stream"

    calls = {"n": 0}
    real = step_module.train_step

    def crashing(*args, **kwargs):  # task 0, in the middle of its second epoch
        calls["n"] += 1
        if calls["n"] == 6:
            raise RuntimeError("power cut")
        return real(*args, **kwargs)

    monkeypatch.setattr(step_module, "train_step", crashing)
    with pytest.raises(RuntimeError, match="power cut"):
        train(tiny_config(*overrides, *STREAM[:2], cache), tmp_path / "cut")
    monkeypatch.undo()
    train(tiny_config(*overrides, *STREAM[:2], cache, "resume=true"), tmp_path / "cut")
    assert matrices(tmp_path / "cut" / "results.json") == expected


@pytest.mark.parametrize("store", ["device", "stream"])
def test_drop_last_trains_whole_batches_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, store: str) -> None:
    """torch's DataLoader(drop_last=True), CODA-Prompt's loader: an epoch of N images in batches of B takes N // B
    steps of B images, from the device store and from the streamed cache alike; a task smaller than a batch is
    refused, naming the key."""
    sizes = []
    real = step_module.train_step

    def counting(method, task, rt, x, y, **kwargs):
        sizes.append((task.id, len(y)))
        return real(method, task, rt, x, y, **kwargs)

    monkeypatch.setattr(step_module, "train_step", counting)
    stream = ("data.store=stream", "data.stream_workers=2", f"data.cache_dir={tmp_path / 'cache'}")
    overrides = ("trainer.batch_size=16", "trainer.drop_last=true", "trainer.epochs=2", "data.num_tasks=2")
    cfg = tiny_config(*overrides, *(stream if store == "stream" else ("data.store=device",)))
    train(cfg, tmp_path / "run")
    train_sizes = [len(split.y) for split in build_benchmark(cfg.data).train[:2]]
    assert all(n % 16 for n in train_sizes)  # each task has a partial last batch to drop
    assert sizes == [(t, 16) for t, n in enumerate(train_sizes) for _ in range(2 * (n // 16))]
    with pytest.raises(ConfigError, match=r"`trainer\.drop_last`"):
        train(tiny_config(*overrides, "trainer.batch_size=4096"), tmp_path / "refused")


@pytest.mark.slow  # 30 s: two gloo processes; a streamed run and its resume stay in the default suite
def test_two_gloo_ranks_streaming_their_shares_equal_two_ranks_on_the_device_store(tmp_path: Path) -> None:
    """Each rank reads its share of every batch, and with mixup (finetune, loss over the task's classes, an even
    batch) also the rows it is mixed with: the accuracy matrices are exactly those of the device store."""
    overrides = (*TINY, "method.loss_scope=task", "trainer.mixup=0.8", "trainer.batch_size=32", "data.val_fraction=0.2")
    stream = ("data.store=stream", f"data.cache_dir={tmp_path / 'cache'}", "data.stream_workers=1")
    for name, extra in (("device", ()), ("stream", stream)):
        folder = f"hydra.run.dir={tmp_path / name}"
        out = torchrun(2, *overrides, *extra, folder, cwd=tmp_path)
        assert out.returncode == 0, said(out)
    a, b = (matrices(tmp_path / d / "results.json") for d in ("device", "stream"))
    assert b["status"] == "finished" and a == b


def children(pid: int) -> list[int]:
    """The child processes of ``pid`` (Linux's /proc/<pid>/task/<tid>/children)."""
    tasks = Path(f"/proc/{pid}/task")
    return [int(child) for t in tasks.iterdir() for child in (t / "children").read_text().split()]


def reader_workers() -> list[int]:
    """The reader workers: the children of this process's multiprocessing fork server."""
    servers = [c for c in children(os.getpid()) if b"forkserver" in Path(f"/proc/{c}/cmdline").read_bytes()]
    return [worker for server in servers for worker in children(server)]


class SignalOnArrival:
    """A ``rows`` argument that reads every row (None) and, unpickled in a reader worker (the first thing a new worker
    does: its dataset arrives pickled), raises ``signum`` in it there and then, before the worker has run a line of
    its own or of the DataLoader's: the earliest moment a terminal's or SLURM's signal can reach it, without timing."""

    def __init__(self, signum: int) -> None:
        self.signum = signum

    def __call__(self, n: int) -> None:
        return None

    def __reduce__(self) -> tuple:
        return (signal.raise_signal, (self.signum,))


@pytest.mark.parametrize(
    ("on_arrival", "once_running"),
    [(None, (signal.SIGTERM, signal.SIGINT)), (signal.SIGTERM, (signal.SIGINT,)), (signal.SIGINT, (signal.SIGTERM,))],
    ids=["once-running", "sigterm-on-arrival", "sigint-on-arrival"],
)
def test_reader_workers_outlive_the_stop_signals_a_job_gets(
    folder: Path, on_arrival: int | None, once_running: tuple[int, ...]
) -> None:
    """SLURM and a terminal's Ctrl-C signal every process of the job, the reader workers too, at any moment: they
    ignore SIGINT and the first SIGTERM from the moment they exist (a signal that arrives before their handlers are
    set waits for them), so the training process can finish its steps (under torchrun, up to the ranks' next
    agreement), write its checkpoint and shut them down itself. Before, a signal that reached a worker before its
    handlers killed it ("DataLoader worker ... exited unexpectedly")."""
    split = build_benchmark(stream_config(folder, store="stream", stream_workers=2)).train[0]
    expected = [x for x, _ in split.batches(2, order=torch.arange(len(split)))]
    rows = SignalOnArrival(on_arrival) if on_arrival is not None else None
    batches = split.batches(2, order=torch.arange(len(split)), rows=rows)
    got = [next(batches)[0]]
    workers = reader_workers()
    assert len(workers) == 2
    for pid in workers:  # whether or not each has set its handlers yet
        for signum in once_running:
            os.kill(pid, signum)
    got += [x for x, _ in batches]
    assert len(got) == len(expected) and all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
