"""Fault injection: every bad input and fault ends in one paragraph naming the key, value or file and the fix, exit 2,
no traceback, and nothing already written lost or changed. (Malformed CIFAR files: tests/test_cifar_faults.py; a NaN
loss: tests/test_run.py and tests/test_cli.py; SIGKILL and SIGTERM mid-run: tests/test_resume.py.)"""

from __future__ import annotations

import errno
import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import save_file

from clbench import files
from clbench.errors import ClbenchError, DataError, Interrupted
from clbench.loop import step as step_module
from clbench.loop import train
from clbench.loop.runtime import Runtime, build_runtime
from clbench.methods import METHODS as ALL_METHODS
from conftest import TINY, baselines_slow, clbench, run_command, tiny_config, tiny_fit
from test_resume import CHECKPOINTED, matrices

TINY_RUN = (*TINY, "data.num_tasks=2", "trainer.epochs=1")

SLOW = pytest.mark.slow


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file of a run folder, by relative path."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def refused(out: subprocess.CompletedProcess, *needles: str) -> None:
    assert out.returncode == 2, out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    for needle in needles:
        assert needle in out.stderr, out.stderr[-3000:]


# --------------------------------------------------------------------------------------------- the command line
@pytest.mark.parametrize(
    ("override", "needles"),
    [
        ("+trainer.foo=1", ("Unknown key(s) in `trainer`: `foo`",)),
        ("+trainer.lrr=1", ("`lrr` (did you mean `lr`?)",)),
        ("trainer.epoch=1", ("`trainer.epoch` is not a key of the trainer config: did you mean `trainer.epochs`?",)),
        ("trainer.epochs=[1", ("no viable alternative",)),
        ("seed=4294967296", ("`seed`: 4294967296", "[0, 2**32)")),
    ],
)
def test_bad_overrides_exit_2_with_one_paragraph(tmp_path: Path, override: str, needles: tuple[str, ...]) -> None:
    refused(clbench(*TINY_RUN, override, f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path), *needles)


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (("data.class_order_seed=-1",), "data.class_order_seed"),
        (("data.resized_crop_scale=[]",), "data.resized_crop_scale"),
        (("backbone.kwargs.embed_dim=62", "backbone.kwargs.num_heads=4"), "backbone.kwargs"),
        (("backbone.img_size=18",), "backbone.img_size"),
        (("method=piggyback", "method.layers=[]"), "method.layers"),
        (("method=meat", "method.layers=[]"), "method.layers"),
        (("method=ksm", "method.group=7"), "method.group"),
    ],
)
def test_bad_values_are_refused_before_training(overrides: tuple[str, ...], key: str) -> None:
    with pytest.raises(ClbenchError, match=rf"`{key}`"):
        build_runtime(tiny_config(*overrides))


def test_a_refused_run_leaves_the_folder_byte_identical(tmp_path: Path) -> None:
    """A refused resume leaves the folder as it was: before, Hydra's .hydra files and clbench.log were rewritten and
    `clbench-eval` refused the folder."""
    run_dir = tmp_path / "run"
    assert clbench(*TINY_RUN, f"hydra.run.dir={run_dir}", cwd=tmp_path).returncode == 0
    (run_dir / files.PID_FILE).write_text("4242\n")  # what a killed run leaves behind
    before = snapshot(run_dir)
    out = clbench(*TINY_RUN, "seed=5", "trainer.lr=0.01", "resume=true", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    refused(out, "seed: checkpoint 0, now 5", "trainer.lr: checkpoint 0.001, now 0.01")
    assert snapshot(run_dir) == before  # .hydra files, clbench.log, the PID file, results.json, checkpoint


@pytest.mark.parametrize(
    ("overrides", "why"),
    [
        ((), "holds a finished run already"),  # a valid run: never written over a finished one
        pytest.param(  # crashed after task 0, before (12 s each: BiC's and KSM's cases in make test-all)
            ("method=bic", "memory.size=null", "memory.per_class=1"), "holds a finished run already", marks=SLOW
        ),
        (("method=gdumb", "memory.sampler=reservoir"), "`memory.sampler`: 'reservoir'"),  # crashed at task 0's fit
        pytest.param(  # a value only the built model refuses
            ("method=ksm", "method.group=3"), "holds a finished run already", marks=SLOW
        ),
    ],
)
def test_no_later_run_changes_a_finished_runs_folder(tmp_path: Path, overrides: tuple[str, ...], why: str) -> None:
    """A new run pointed at a finished run's folder is refused before anything is written. Before, BiC with one image
    a class and GDumb with a reservoir ran into it, crashed once training started, and left it with results.json
    rewritten as failed with empty matrices, the CSVs emptied, .hydra rewritten (and BiC's checkpoint.pt)."""
    run_dir = tmp_path / "run"
    assert clbench(*TINY_RUN, f"hydra.run.dir={run_dir}", cwd=tmp_path).returncode == 0
    before = snapshot(run_dir)
    refused(clbench(*TINY_RUN, *overrides, f"hydra.run.dir={run_dir}", cwd=tmp_path), why)
    assert snapshot(run_dir) == before


def test_a_finished_run_resumed_is_left_as_it_was(tmp_path: Path) -> None:
    """resume=true (or a requeued job's resume=auto) on a finished run has nothing to do: it says so, exits 0 and writes
    nothing (a failure there could otherwise write `failed` over the finished results)."""
    run_dir = tmp_path / "run"
    assert clbench(*TINY_RUN, f"hydra.run.dir={run_dir}", cwd=tmp_path).returncode == 0
    before = snapshot(run_dir)
    out = clbench(*TINY_RUN, "resume=true", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert out.returncode == 0 and "holds a finished run: nothing to resume" in out.stdout + out.stderr, out.stderr
    assert snapshot(run_dir) == before
    (run_dir / "checkpoint.pt").unlink()  # a finished run whose checkpoint was deleted to save space
    before = snapshot(run_dir)
    refused(clbench(*TINY_RUN, "resume=auto", f"hydra.run.dir={run_dir}", cwd=tmp_path), "holds a finished run")
    assert snapshot(run_dir) == before


@pytest.mark.parametrize("overrides", [("data=cifar100_10tasks",), ("method=ksm", "method.group=3")])
def test_a_refused_run_leaves_no_folder_behind(tmp_path: Path, overrides: tuple[str, ...]) -> None:
    """Refused once Hydra has written the folder (missing data; a value only the built model refuses): the folder
    made for it, and its parents made with it, are removed; an existing parent is kept."""
    out = clbench(*TINY_RUN, *overrides, f"hydra.run.dir={tmp_path / 'new' / 'day' / 'run'}", cwd=tmp_path)
    assert out.returncode == 2, out.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_sweep_is_never_written_over_an_earlier_one_and_its_refused_jobs_leave_no_folder(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    out = clbench("-m", *TINY_RUN, "seed=0", "method=ksm", "method.group=1,3", f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert out.returncode == 2, out.stderr[-3000:]  # a sweep with a refused job says so in its exit code
    assert "sweep of 2 jobs: 1 done, 1 refused." in out.stderr
    jobs = sorted(p.name for p in sweep.iterdir() if p.is_dir() and not p.name.startswith("."))
    assert len(jobs) == 1 and jobs[0].startswith("0_")  # the refused job (group=3) left none
    before = snapshot(sweep)
    out = clbench("-m", *TINY_RUN, "seed=0,1", f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    refused(out, f"The sweep folder {sweep} holds runs already (1 jobs' folders: {jobs[0]})", "resume=auto")
    assert snapshot(sweep) == before


def test_a_bad_value_is_refused_before_hydra_writes_the_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The run-folder guard (Hydra's on_run_start, before the .hydra files and the log) validates the config: a bad
    value in a finished run's folder left it with another run's .hydra files and log, refused by `clbench-eval`."""
    from hydra import compose, initialize_config_dir

    from clbench.cli import RunFolderGuard
    from clbench.config import config_dir

    run_dir = tmp_path / "run"
    overrides = [*TINY_RUN, "method=tfm", "method.growth=0", f"hydra.run.dir={run_dir}"]
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        config = compose("config", overrides=overrides, return_hydra_config=True)
    with pytest.raises(SystemExit) as exit_:
        RunFolderGuard().on_run_start(config)
    assert exit_.value.code == 2 and "`method.growth`: 0.0" in capsys.readouterr().err
    assert not run_dir.exists()


def test_resume_on_a_missing_folder_is_refused_without_creating_it(tmp_path: Path) -> None:
    refused(clbench(*TINY_RUN, "resume=true", f"hydra.run.dir={tmp_path / 'none'}", cwd=tmp_path), "does not exist")
    assert not (tmp_path / "none").exists()


def test_a_second_writer_is_refused_with_the_holders_pid_and_a_killed_holder_frees_the_folder(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    holder = subprocess.Popen(  # a clbench process holding the folder (as a running run does)
        [sys.executable, "-c", f"from pathlib import Path; from clbench.files import lock_run_folder; "
         f"lock_run_folder(Path({str(run_dir)!r})); print('held', flush=True); import time; time.sleep(10**6)"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        out = clbench(*TINY_RUN, f"hydra.run.dir={run_dir}", cwd=tmp_path)
        refused(out, f"is in use by another clbench run (PID {holder.pid})")
        assert not (run_dir / ".hydra").exists()  # refused before Hydra wrote anything
    finally:
        holder.kill()  # SIGKILL: the lock file and the PID file stay behind, the OS lock does not
        holder.wait()
    assert (run_dir / files.PID_FILE).read_text().strip() == str(holder.pid)
    out = clbench(*TINY_RUN, f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]


def test_weights_that_belong_to_another_network_are_refused_listing_the_keys(tmp_path: Path) -> None:
    path = tmp_path / "other.safetensors"
    save_file({"encoder.layer.0.weight": torch.zeros(4, 4), "encoder.layer.0.bias": torch.zeros(4)}, str(path))
    # the 1-block ViT of TINY has 18 tensors (cls_token, pos_embed, patch_embed x2, 12 in the block, the final norm x2)
    out = clbench(*TINY_RUN, f"backbone.weights={path}", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    refused(
        out,
        str(path),
        "missing 18: blocks.0.attn.proj.bias",
        "unexpected 2: encoder.layer.0.bias, encoder.layer.0.weight",
    )


def test_weights_with_one_extra_tensor_are_refused(tmp_path: Path) -> None:
    method, _ = build_runtime(tiny_config())
    path = tmp_path / "extra.safetensors"
    save_file({**method.backbone.state_dict(), "adapter.weight": torch.zeros(2)}, str(path))
    with pytest.raises(ClbenchError, match=r"unexpected 1: adapter\.weight"):
        build_runtime(tiny_config(f"backbone.weights={path}"))
    head = {"head.weight": torch.zeros(3, 32), "head.bias": torch.zeros(3)}  # a classifier is dropped, as timm does
    save_file({**method.backbone.state_dict(), **head}, str(path))
    build_runtime(tiny_config(f"backbone.weights={path}"))


def test_a_signal_during_start_up_ends_in_one_paragraph(tmp_path: Path) -> None:
    script = f"""
import os, signal, sys
import clbench.loop.run as run
real = run.build_runtime
def build(*a, **k):
    os.kill(os.getpid(), signal.SIGTERM)
    return real(*a, **k)
run.build_runtime = build
sys.argv = ["clbench", *{list(TINY_RUN)!r}, "hydra.run.dir={tmp_path / "run"}"]
from clbench.cli import main
main()
"""
    out = run_command(sys.executable, "-c", script, cwd=tmp_path)
    refused(out, "stopped by SIGTERM outside training", "resume=auto")
    with pytest.raises(Interrupted, match="SIGINT"):
        from clbench.cli import interrupted

        interrupted(signal.SIGINT, None)


def test_a_stop_signal_while_the_method_is_imported_is_an_interruption_not_a_bad_target(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Hydra wraps what an import raises in an ImportError: the CLI's Interrupted was reported as "`method._target_`
    ... cannot be imported", blaming the config."""
    from clbench.cli import interrupted
    from clbench.config import validate
    from conftest import compose_config

    (tmp_path / "clbench_slow_method.py").write_text("import os, signal\nos.kill(os.getpid(), signal.SIGINT)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    previous = signal.signal(signal.SIGINT, interrupted)
    try:
        with pytest.raises(Interrupted, match=r"^Interrupted: stopped by SIGINT outside training"):
            validate(compose_config("method._target_=clbench_slow_method.Method"))
    finally:
        signal.signal(signal.SIGINT, previous)


def test_clbench_eval_refuses_a_corrupt_results_json_and_names_a_stage_mismatch(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    assert clbench(*TINY_RUN, f"hydra.run.dir={run_dir}", cwd=tmp_path).returncode == 0
    results = run_dir / "results.json"
    good = json.loads(results.read_text())
    results.write_text('{"acc_matrix": {"til": [[50.0')  # cut off mid-write
    out = run_command(sys.executable, "-m", "clbench.reevaluate", str(run_dir), cwd=tmp_path)
    refused(out, "results.json is corrupt")
    good["acc_matrix"] = {s: rows[:1] for s, rows in good["acc_matrix"].items()}  # killed before task 1's row
    results.write_text(json.dumps(good))
    out = run_command(sys.executable, "-m", "clbench.reevaluate", str(run_dir), cwd=tmp_path)
    assert out.returncode == 0 and "has no row after task 1" in " ".join(out.stderr.split()), out.stderr


# --------------------------------------------------------------------------------------------- the run folder
def test_a_full_disk_is_a_clear_error_and_the_previous_file_stays(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "results.json"
    files.write_atomic(path, "previous")

    def no_space(*_args: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(files.os, "replace", no_space)
    with pytest.raises(DataError, match=r"No space left to write .*results\.json"):
        files.write_atomic(path, "new")
    assert path.read_text() == "previous" and not list(tmp_path.glob(".*.tmp"))


def test_files_follow_the_umask_and_stale_temporaries_are_removed(tmp_path: Path) -> None:
    stale = tmp_path / ".results.json.abc123.tmp"  # left by a killed write
    stale.write_text("partial")
    train(tiny_config("data.num_tasks=1", "trainer.epochs=1"), tmp_path)
    assert not stale.exists()
    mask = os.umask(0)
    os.umask(mask)
    for name in ("results.json", "acc_matrix_til.csv", "heatmap_til.png"):
        assert (tmp_path / name).stat().st_mode & 0o777 == 0o666 & ~mask, name


def test_the_log_holds_what_the_run_printed_and_a_line_per_epoch(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    out = clbench(*TINY_RUN, "method=piggyback", "trainer.log_every=1000", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    log = (run_dir / "clbench.log").read_text()
    for text in ("task 0 train epoch 1/1: loss", "task 1: TIL", "Metrics (%)", "expect numbers near chance"):
        assert text in log, text
        assert text in out.stderr, text  # not a terminal: the epoch lines replace the progress bar


def test_parallel_jobs_split_the_cores() -> None:
    from clbench.cli import share_cores

    threads = torch.get_num_threads()
    try:
        share_cores(OmegaConf.create({"_target_": "hydra_plugins.hydra_joblib_launcher.JoblibLauncher", "n_jobs": 2}))
        assert torch.get_num_threads() == max(1, len(os.sched_getaffinity(0)) // 2)
    finally:
        torch.set_num_threads(threads)


# --------------------------------------------------------------------------------------------- crashes, then resume
METHODS = ALL_METHODS


# A method whose crash at chosen points runs in the default suite (tests/test_resume.py: finetune is kept here as the
# drawn point's own check), or whose checkpoint replay mid-task (EASE's and TUNA's, tests/test_ease.py,
# tests/test_tuna.py) or artifacts (MOS's, tests/test_mos.py) do, has its drawn point in make test-all (the default
# suite's budget)
CHOSEN_POINTS = ("simplecil", "packnet", "hat", "meat", "l2p", "supsup", "aper", "ranpac", "sdlora", "inflora", "min")
# the mask survey's APD, CTR and KSM (5-6 s each): TFM's drawn point stays for the family
SURVEY_DRAWN_SLOW = ("apd", "ctr", "ksm")


@pytest.mark.parametrize(
    "method", baselines_slow(METHODS, also=(*CHOSEN_POINTS, *SURVEY_DRAWN_SLOW, "ease", "mos", "tuna", "hide"))
)
def test_a_crash_at_a_seeded_random_point_resumes_to_the_uninterrupted_results(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, method: str
) -> None:
    """A crash at a point drawn per method (a training step or an evaluation; seeded, so reproducible) and a resume
    give the matrices of an uninterrupted run, bit for bit."""
    extra = ("method.retrain_epochs=1",) if method == "packnet" else ()
    overrides = (f"method={method}", *CHECKPOINTED, *extra)
    train(tiny_config(*overrides), tmp_path / "whole")
    expected = matrices(tmp_path / "whole" / "results.json")
    rng = random.Random(f"crash:{method}")
    where = "evaluate" if method == "simplecil" else rng.choice(["step", "evaluate"])
    count = rng.randint(1, 7 if where == "evaluate" else 14)
    calls = {"n": 0}
    real = step_module.train_step if where == "step" else Runtime.evaluate

    def crashing(*args: object, **kwargs: object) -> object:
        calls["n"] += 1
        if calls["n"] == count:
            raise RuntimeError("power cut")
        return real(*args, **kwargs)

    monkeypatch.setattr(*((step_module, "train_step") if where == "step" else (Runtime, "evaluate")), crashing)
    with pytest.raises(RuntimeError, match="power cut"):
        train(tiny_config(*overrides), tmp_path / "cut")
    monkeypatch.undo()
    train(tiny_config(*overrides, "resume=auto"), tmp_path / "cut")
    assert matrices(tmp_path / "cut" / "results.json") == expected, (where, count)


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
def test_a_sigkill_at_a_seeded_random_checkpoint_resumes_to_the_uninterrupted_results(
    tmp_path: Path, method: str
) -> None:
    """The process killed outright (SIGKILL, no handler runs) right after its k-th checkpoint write, k drawn per method,
    then `resume=true`: the same matrices as an uninterrupted run."""
    from test_resume import clbench_killing_itself

    extra = ("method.retrain_epochs=1",) if method == "packnet" else ()
    chosen = f"method={method}"
    overrides = (*TINY, *tiny_fit(chosen), *CHECKPOINTED, chosen, *extra, "logger.mode=disabled")
    whole = clbench(*overrides, f"hydra.run.dir={tmp_path / 'whole'}", cwd=tmp_path)
    assert whole.returncode == 0, whole.stderr[-2000:]
    after = random.Random(f"kill:{method}").randint(1, 2 if method == "simplecil" else 4)  # simplecil: 3 writes
    killed = clbench_killing_itself(tmp_path / "cut", "KILL", after, *overrides)
    assert killed.returncode == -9, killed.stderr[-2000:]
    resumed = clbench(*overrides, "resume=true", f"hydra.run.dir={tmp_path / 'cut'}", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert matrices(tmp_path / "cut" / "results.json") == matrices(tmp_path / "whole" / "results.json"), after
