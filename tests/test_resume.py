"""Checkpoints and resume: a run stopped anywhere (crash, SIGKILL, SIGTERM) continues to the same results."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from clbench import checkpoint
from clbench.errors import ConfigError, DataError
from clbench.loop import step as step_module
from clbench.loop import train
from clbench.loop.runtime import Runtime
from clbench.methods import PTM_METHODS
from conftest import TINY, clbench, run_command, tiny_config, tiny_fit

CHECKPOINTED = ("trainer.checkpoint_every=1", "trainer.epochs=2", "data.val_fraction=0.2")


def matrices(results_json: Path) -> dict:
    res = json.loads(results_json.read_text())
    keys = ("acc_matrix", "before_task_acc", "random_init_acc", "validation", "task_confusion", "status")
    return {k: res.get(k) for k in keys}


@pytest.mark.parametrize(
    ("method", "crash_at"),
    [
        ("finetune", ("step", 5)),  # mid-task (task 0, epoch 1)
        ("finetune", ("evaluate", 6)),  # between tasks: 3 random-init probes, task 0 (val, test), task 1 untrained
        ("simplecil", ("evaluate", 6)),  # the same for a method without gradient steps (an observe phase)
        ("packnet", ("step", 13)),  # task 0's retrain phase
        ("hat", ("step", 11)),
        ("meat", ("step", 9)),
        ("l2p", ("step", 14)),
        ("supsup", ("step", 7)),
        ("aper", ("step", 4)),  # its first session, after the first epoch's checkpoint
        pytest.param("ranpac", ("step", 4), marks=pytest.mark.slow),  # APER's first session above in the default suite
        ("ranpac", ("evaluate", 6)),  # after task 0: the ridge statistics come back from the checkpoint
        ("min", ("step", 11)),  # in task 1's noise phase: its fit passes' statistics, its generator, W_aux, omega
        pytest.param("min", ("evaluate", 6), marks=pytest.mark.slow),  # the mid-task case above in the default suite
        # SD-LoRA and InfLoRA: one case each in the default suite (mid task 1: the bank, the bases, the current
        # component all come back), the rest in make test-all
        pytest.param("sdlora", ("step", 4), marks=pytest.mark.slow),  # mid-task: the current component, magnitudes
        pytest.param("sdlora", ("evaluate", 6), marks=pytest.mark.slow),  # between tasks: the bank, carried magnitudes
        ("sdlora-reset", ("step", 11)),  # mid task 1 on the code's path: the renormalised bank, the reset magnitudes
        pytest.param("inflora", ("step", 4), marks=pytest.mark.slow),  # mid-task: the designed A_t (no data to redo it)
        pytest.param("inflora", ("evaluate", 6), marks=pytest.mark.slow),  # between tasks: the DualGPM bases
        ("inflora-before", ("step", 11)),  # mid task 1: task 0's bases, A_1, the design pass's moments growing the next
        # EASE: task 1, epoch 1 (its adapter set and proxy head mid-training, task 0's kept), and after task 0; in the
        # default suite its checkpoint replay mid-task (tests/test_ease.py)
        pytest.param("ease", ("step", 10), marks=pytest.mark.slow),
        pytest.param("ease", ("evaluate", 6), marks=pytest.mark.slow),
        # MOS (steps: 6 a task, then 120 and 180 alignment steps): mid task 1's training (set 1 continued from set 0,
        # the prefix sum, the class means L_proto reads), and in official mode mid task 1's alignment (the drifting
        # cur_adapter, set 2, carried); the artifacts' round trip in the default suite (tests/test_mos.py)
        pytest.param("mos", ("step", 10), marks=pytest.mark.slow),
        pytest.param("mos-official", ("step", 70), marks=pytest.mark.slow),
        # TUNA: mid task 1 (its set carried on from task 0's, mid-training; the universal adapter not merged yet) and
        # after task 1 (merged, the heads aligned); in the default suite its checkpoint replay mid-task (test_tuna.py)
        pytest.param("tuna", ("step", 10), marks=pytest.mark.slow),
        pytest.param("tuna", ("evaluate", 6), marks=pytest.mark.slow),
        # HiDe, in make test-all (5 s each, past the default suite's budget): task 1's head alignment, epoch 1 (its
        # TAP clusters, the slot in the bank, TII's aligned MLP), its LoRA slot mid-training (task 1's WTP) and the
        # lifecycle after task 0
        pytest.param("hide", ("step", 32), marks=pytest.mark.slow),
        pytest.param("hide-lora", ("step", 24), marks=pytest.mark.slow),
        pytest.param("hide", ("evaluate", 6), marks=pytest.mark.slow),
    ],
)
def test_resume_after_a_crash_gives_the_uninterrupted_results(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, method: str, crash_at: tuple[str, int]
) -> None:
    method, _, variant = method.partition("-")
    extra = {
        "packnet": ("method.retrain_epochs=1",),
        "sdlora": ("method.alpha_carry=reset",) if variant else (),
        "inflora": ("method.subspace_pass=before",) if variant else (),
        "mos": ("method.merge_mode=official",) if variant else (),
        "hide": ("method.peft=lora",) if variant else (),
    }.get(method, ())
    overrides = (f"method={method}", *CHECKPOINTED, *extra)
    train(tiny_config(*overrides), tmp_path / "whole")
    expected = matrices(tmp_path / "whole" / "results.json")

    where, count = crash_at
    calls = {"n": 0}
    real = step_module.train_step if where == "step" else Runtime.evaluate

    def crashing(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == count:
            raise RuntimeError("power cut")
        return real(*args, **kwargs)

    if where == "step":
        monkeypatch.setattr(step_module, "train_step", crashing)
    else:
        monkeypatch.setattr(Runtime, "evaluate", crashing)
    with pytest.raises(RuntimeError, match="power cut"):
        train(tiny_config(*overrides), tmp_path / "cut")
    monkeypatch.undo()
    assert matrices(tmp_path / "cut" / "results.json")["status"] == "failed"
    train(tiny_config(*overrides, "resume=true"), tmp_path / "cut")
    assert matrices(tmp_path / "cut" / "results.json") == expected


def clbench_killing_itself(run_dir: Path, kill: str, after: int, *overrides: str) -> subprocess.CompletedProcess:
    """Run clbench in a process that sends itself ``kill`` (KILL: after its ``after``-th checkpoint; TERM or USR2:
    at its ``after``-th training step). For USR2 a stand-in for submitit's handler is installed first: it writes
    the batch position of the checkpoint it finds to ``requeued`` (where submitit requeues the job) and exits as
    submitit does."""
    script = f"""
import os, signal, sys
import clbench.checkpoint as ckpt, clbench.loop.step as run
count = {{"n": 0}}
def requeue(signum, frame):
    position, _ = ckpt.load(__import__("pathlib").Path("{run_dir}"))
    open("{run_dir.parent / "requeued"}", "w").write(str(position.cursor.batch))
    sys.exit(-1)
signal.signal(signal.SIGUSR2, requeue)
if "{kill}" == "KILL":
    real = ckpt.save
    def save(*a, **k):
        real(*a, **k)
        count["n"] += 1
        if count["n"] == {after}:
            os.kill(os.getpid(), signal.SIGKILL)
    ckpt.save = save
else:
    real = run.train_step
    def step(*a, **k):
        count["n"] += 1
        if count["n"] == {after}:
            os.kill(os.getpid(), getattr(signal, "SIG{kill}"))
        return real(*a, **k)
    run.train_step = step
sys.argv = ["clbench", *{list(overrides)!r}, "hydra.run.dir={run_dir}"]
from clbench.cli import main
main()
"""
    return run_command(sys.executable, "-c", script, cwd=run_dir.parent)


# Where each run is killed: after its n-th checkpoint. Finetune's tasks checkpoint after epoch 0 (mid-task), epoch 1
# and the task (between tasks). SLCA's task 0 the same (1-3); task 1 after its two epochs (4, 5), each of its 5
# alignment epochs (6-10: 7 is mid-alignment, the draw of its third epoch made again on resume) and the task (11: the
# recall of the pre-alignment heads before task 2 reads them from the checkpoint).
KILLS = {
    "finetune": ((), (("mid_task", 4), ("between_tasks", 6))),
    "slca": (
        ("method=slca", "method.alignment.samples_per_class=8", "method.alignment.batch_size=8"),
        (("mid_align", 7), ("between_tasks", 11)),
    ),
}


@pytest.mark.parametrize("method", ["finetune", pytest.param("slca", marks=pytest.mark.slow)])
def test_sigkill_mid_task_and_between_tasks_then_resume(tmp_path: Path, method: str) -> None:
    chosen, kills = KILLS[method]
    overrides = (*TINY, *CHECKPOINTED, *chosen, "logger.mode=offline")
    whole = clbench(*overrides, f"hydra.run.dir={tmp_path / 'whole'}", cwd=tmp_path)
    assert whole.returncode == 0, whole.stderr[-2000:]
    expected = matrices(tmp_path / "whole" / "results.json")
    for name, after in kills:
        run_dir = tmp_path / name
        killed = clbench_killing_itself(run_dir, "KILL", after, *overrides)
        assert killed.returncode == -9, killed.stderr[-2000:]
        position, _ = checkpoint.load(run_dir)
        assert (position.cursor is None) == (name == "between_tasks")
        resumed = clbench(*overrides, "resume=true", f"hydra.run.dir={run_dir}", cwd=tmp_path)
        assert resumed.returncode == 0, resumed.stderr[-2000:]
        assert matrices(run_dir / "results.json") == expected, name
        runs = sorted((run_dir / "wandb").glob("offline-run-*"))
        assert len(runs) == 2 and len({r.name.rsplit("-", 1)[-1] for r in runs}) == 1  # the same W&B run id


@pytest.mark.slow
@pytest.mark.parametrize("method", PTM_METHODS)
def test_a_pretrained_model_method_killed_in_or_after_its_first_task_resumes_to_the_same_results(
    tmp_path: Path, method: str
) -> None:
    """SIGKILL after the first epoch's checkpoint of the first task (the PETL module, EASE's first adapter set or
    SLCA's slowly learning ViT, and the head mid-training) and after the first task's (the prototypes, the class
    Gaussians, or the ridge statistics G and Q with the projection's seed), then resume=true: the uninterrupted run's
    matrices."""
    overrides = (*TINY, *tiny_fit(f"method={method}"), *CHECKPOINTED, f"method={method}", "logger.mode=disabled")
    whole = clbench(*overrides, f"hydra.run.dir={tmp_path / 'whole'}", cwd=tmp_path)
    assert whole.returncode == 0, whole.stderr[-2000:]
    expected = matrices(tmp_path / "whole" / "results.json")
    # saves: epoch 0, epoch 1, the task's end (HiDe: its TII epoch first)
    for name, after in (("in_session", 1), ("after_task_0", 4 if method == "hide" else 3)):
        run_dir = tmp_path / name
        killed = clbench_killing_itself(run_dir, "KILL", after, *overrides)
        assert killed.returncode == -9, killed.stderr[-2000:]
        position, _ = checkpoint.load(run_dir)
        assert (position.task, position.cursor is None) == ((0, False) if name == "in_session" else (1, True))
        resumed = clbench(*overrides, "resume=true", f"hydra.run.dir={run_dir}", cwd=tmp_path)
        assert resumed.returncode == 0, resumed.stderr[-2000:]
        assert matrices(run_dir / "results.json") == expected, name


def test_sigterm_writes_a_checkpoint_mid_epoch_and_exits_cleanly(tmp_path: Path) -> None:
    overrides = (*TINY, *CHECKPOINTED, "logger.mode=disabled")
    train(tiny_config(*CHECKPOINTED), tmp_path / "whole")
    expected = matrices(tmp_path / "whole" / "results.json")
    run_dir = tmp_path / "term"
    stopped = clbench_killing_itself(run_dir, "TERM", 9, *overrides)  # task 1, inside its first epoch
    assert stopped.returncode == 0, stopped.stderr[-2000:]
    assert "resume=true" in stopped.stderr
    assert json.loads((run_dir / "results.json").read_text())["status"] == "interrupted"
    position, _ = checkpoint.load(run_dir)
    assert position.task == 1 and position.cursor is not None and position.cursor.batch > 0
    resumed = clbench(*overrides, "resume=true", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert matrices(run_dir / "results.json") == expected


def test_a_slurm_time_limit_checkpoints_requeues_and_the_requeued_job_resumes(tmp_path: Path) -> None:
    overrides = (*TINY, *CHECKPOINTED, "logger.mode=disabled")
    train(tiny_config(*CHECKPOINTED), tmp_path / "whole")
    expected = matrices(tmp_path / "whole" / "results.json")
    run_dir = tmp_path / "job"
    stopped = clbench_killing_itself(run_dir, "USR2", 9, *overrides)  # submitit's signal before the time limit
    assert stopped.returncode == 255, stopped.stderr[-2000:]  # submitit's handler exits with -1 after requeueing
    position, _ = checkpoint.load(run_dir)
    assert position.task == 1 and position.cursor is not None and position.cursor.batch > 0  # the signal's step
    assert (tmp_path / "requeued").read_text() == str(position.cursor.batch)  # the handler saw that checkpoint
    # the requeued job: the same command, no resume=true
    again = clbench(*overrides, f"hydra.run.dir={run_dir}", cwd=tmp_path, SLURM_RESTART_COUNT="1")
    assert again.returncode == 0, again.stderr[-2000:]
    assert matrices(run_dir / "results.json") == expected


def test_resume_auto_starts_fresh_without_a_checkpoint_and_resumes_with_one(tmp_path: Path) -> None:
    fresh = train(tiny_config(*CHECKPOINTED, "data.num_tasks=1", "resume=auto"), tmp_path)
    assert fresh.status == "finished"
    again = train(tiny_config(*CHECKPOINTED, "data.num_tasks=1", "resume=auto"), tmp_path)
    assert again.rows == fresh.rows and again.timing["train_s"] == fresh.timing["train_s"]  # nothing retrained


def test_resume_refuses_another_run_and_a_corrupt_checkpoint(tmp_path: Path) -> None:
    train(tiny_config(*CHECKPOINTED, "data.num_tasks=1"), tmp_path)
    with pytest.raises(ConfigError, match=r"Cannot resume .*method"):
        train(tiny_config(*CHECKPOINTED, "data.num_tasks=1", "method=joint", "resume=true"), tmp_path)
    path = tmp_path / checkpoint.FILE
    path.write_bytes(path.read_bytes()[:100])  # truncated
    before = path.read_bytes()
    with pytest.raises(DataError, match=r"checkpoint\.pt is corrupt"):
        train(tiny_config(*CHECKPOINTED, "data.num_tasks=1", "resume=true"), tmp_path)
    assert path.read_bytes() == before  # nothing overwritten
    with pytest.raises(DataError, match=r"does not exist"):
        train(tiny_config(*CHECKPOINTED, "resume=true"), tmp_path / "empty")
    assert not (tmp_path / "empty").exists()  # resume=true on a missing folder does not create it


def test_the_checkpoint_loads_with_weights_only() -> None:
    state = {"rng": checkpoint.rng_state(), "x": torch.ones(2)}
    path = Path(os.environ.get("TMPDIR", "/tmp")) / "clbench_weights_only_probe.pt"
    torch.save(state, path)
    assert torch.load(path, weights_only=True)["x"].sum() == 2
    path.unlink()


def test_an_unwritable_output_folder_is_refused_before_training(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(ConfigError, match=r"Cannot write in the output folder .*hydra\.run\.dir"):
        train(tiny_config(), blocker / "run")


def test_online_logging_without_network_falls_back_to_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # nothing listens there
    cfg = tiny_config("data.num_tasks=1", "trainer.epochs=1", "logger.mode=online", "logger.online_timeout=5")
    results = train(cfg, tmp_path)
    assert results.status == "finished"
    assert list((tmp_path / "wandb").glob("offline-run-*"))


def test_a_clbench_process_logs_through_a_wandb_service_of_its_own(tmp_path: Path) -> None:
    """A process that called wandb.init (a notebook, a test runner) exports WANDB_SERVICE to its children; a clbench
    run that joined that service would leave a killed run's stream open there and have its resume refused ("run ID
    ... is in use", seen under load). A service address that leads nowhere shows the run does not use it."""
    out = clbench(*TINY, "logger.mode=offline", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path,
                  WANDB_SERVICE="3-1-unix-/nonexistent/socket")  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert list((tmp_path / "run" / "wandb").glob("offline-run-*"))
