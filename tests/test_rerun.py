"""After a stop: the literal command that resumes the run, a rerun of the same command that says what it leaves
behind, and a resumed run that says it resumed; and the end of a sweep, one summary and an exit code that is not 0
when a job did not finish."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

from clbench.loop import train
from clbench.sweep_summary import numbers, summary
from conftest import TINY, clbench, run_command, tiny_config
from test_resume import clbench_killing_itself, matrices

STOPPABLE = (*TINY, "data.num_tasks=2", "trainer.epochs=2", "trainer.checkpoint_every=1", "logger.mode=disabled")


def pasted(command: str) -> list[str]:
    """The command a user pastes, as this test's Python runs it (``clbench`` is the console script of this venv)."""
    words = shlex.split(command)
    return [sys.executable, "-m", "clbench", *words[1:]] if words[0] == "clbench" else words


def overrides(command: str) -> list[str]:
    return [w for w in shlex.split(command) if "=" in w]


def test_a_stopped_run_prints_the_command_that_resumes_it_and_a_rerun_says_what_it_leaves(tmp_path: Path) -> None:
    """SIGTERM in task 1: the message ends with a command to paste; the same command run again (a new folder, as
    every run's) says first which stopped run it leaves behind and how to resume it; the pasted command resumes,
    says so, and ends with the results of a run never stopped."""
    expected = matrices(train(tiny_config(*STOPPABLE[len(TINY) :]), tmp_path / "whole").write(tmp_path / "whole"))
    stopped_dir = tmp_path / "outputs" / "2026-01-01" / "10-00-00_finetune_synthetic_tiny_first2"
    stopped_dir.parent.mkdir(parents=True)
    stopped = clbench_killing_itself(stopped_dir, "TERM", 9, *STOPPABLE)
    assert stopped.returncode == 0, stopped.stderr[-2000:]
    said = stopped.stderr.split("to go on where it stopped, run:\n", 1)[1].splitlines()[0].strip()
    assert shlex.split(said)[-2:] == ["resume=true", f"hydra.run.dir={stopped_dir.resolve()}"]

    again = clbench(*STOPPABLE, cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-2000:]
    notice = again.stderr.split("clbench: warning: this command's run in ", 1)[1]
    assert notice.startswith(f"{stopped_dir} stopped after 1 of its 2 tasks, with a checkpoint; this is a new run")
    offered = notice.split("and run:\n", 1)[1].splitlines()[0].strip()
    assert overrides(offered) == overrides(said)  # the program's words are this process's: python -m clbench here
    assert len(list((tmp_path / "outputs").glob("*/*_finetune_synthetic_tiny_first2"))) == 2

    resumed = run_command(*pasted(said), cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    unwrapped = "".join(resumed.stderr.split())  # the console wraps long lines, inside a path too
    assert "".join(f"clbench: resumed {stopped_dir.resolve()} from its checkpoint, in task 1 of 2".split()) in unwrapped
    assert matrices(stopped_dir / "results.json") == expected


def test_a_sweep_ends_with_one_summary_and_exit_2_when_every_job_is_refused(tmp_path: Path) -> None:
    """Three jobs refused for one reason (the dataset is missing): the reason once in full, a line for each job
    after the first, one summary grouping them, exit code 2 (a user error, as a single run's)."""
    out = clbench(
        "-m",
        "data=cifar100_10tasks",
        f"data.root={tmp_path / 'empty'}",
        "logger.mode=disabled",
        "seed=0,1,2",
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
        cwd=tmp_path,
    )
    assert out.returncode == 2, out.stderr[-3000:]
    assert out.stderr.count("cifar100: CIFAR-100") == 2  # the job's paragraph and the summary's reason
    assert "clbench: job 1 refused: as job 0, above." in out.stderr and "job 2 refused: as job 0" in out.stderr
    assert "clbench: sweep of 3 jobs: 0 done, 3 refused." in out.stderr
    assert "  refused, 3 jobs (0-2): a prerequisite is missing" in out.stderr
    assert not (tmp_path / "sweep" / ".clbench_jobs").exists()


def test_a_sweep_with_a_failed_job_exits_1_and_counts_every_outcome(tmp_path: Path) -> None:
    """lr 1e-3 trains, lr 1e30 diverges (a failed run), lr -1 is refused before any work."""
    out = clbench(
        "-m",
        *TINY,
        "data.num_tasks=1",
        "trainer.epochs=1",
        "trainer.lr=0.001,1e30,-1",
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
        cwd=tmp_path,
    )
    assert out.returncode == 1, out.stderr[-3000:]
    assert "clbench: sweep of 3 jobs: 1 done, 1 failed, 1 refused." in out.stderr
    assert "  failed, job (1): the mean training loss" in out.stderr
    assert "  refused, job (2): Invalid value for `trainer.lr`: -1.0" in out.stderr
    statuses = [json.loads(p.read_text())["status"] for p in sorted((tmp_path / "sweep").glob("[01]_*/results.json"))]
    assert statuses == ["finished", "failed"]


def test_the_summary_groups_identical_reasons_and_counts_a_killed_job() -> None:
    entries = [
        {"job": 0, "outcome": "done"},
        {"job": 1, "outcome": "refused", "reason": "no data"},
        {"job": 2, "outcome": "refused", "reason": "no data"},
        {"job": 3, "outcome": "started"},
    ]
    lines, code = summary(entries)
    assert numbers([0, 1, 2, 5, 6, 9, 10, 11, 12]) == "0-2, 5, 6, 9-12"
    assert lines[0] == "clbench: sweep of 4 jobs: 1 done, 2 refused, 1 killed."
    assert lines[1] == "  refused, 2 jobs (1, 2): no data"
    assert lines[2].startswith("  killed, job (3): started and never ended") and code == 1
    assert summary(entries[:3]) == (["clbench: sweep of 3 jobs: 1 done, 2 refused.", lines[1]], 2)
    assert summary(entries[:1]) == (["clbench: sweep of 1 jobs: 1 done."], 0)
