"""A method's own diagnostics (the values its loss logs: MEAT's token keep ratio, ...) in results.json and the run's
summary, not only in W&B."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from clbench.loop import train
from clbench.methods.meat import MEAT
from clbench.tracking import diagnostics_tables
from conftest import crash_and_resume, tiny_config

MEAT_RUN = ("method=meat", "trainer.epochs=2", "trainer.checkpoint_every=1", "trainer.eval_random_init=false")


def test_each_phase_records_the_mean_of_every_value_its_loss_logged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The mean over a phase's steps of each logged value, against the values read on the host at every step."""
    seen: list[dict[str, float]] = []
    real = MEAT.training_loss

    def logged(self: MEAT, *args: object) -> object:
        loss, logs = real(self, *args)
        seen.append({k: float(v) for k, v in logs.items()})
        return loss, logs

    monkeypatch.setattr(MEAT, "training_loss", logged)
    results = train(tiny_config(*MEAT_RUN), tmp_path / "run")
    entries = json.loads((tmp_path / "run" / "results.json").read_text())["method_diagnostics"]
    assert [(e["task"], e["phase"]) for e in entries] == [(0, "train"), (1, "train"), (2, "train")]
    start = 0
    for entry in entries:
        steps = seen[start : start + entry["steps"]]
        start += entry["steps"]
        for key in ("token_keep_ratio", "drop_control"):
            assert entry[key] == pytest.approx(statistics.fmean(s[key] for s in steps), rel=1e-5)
        assert 0 < entry["token_keep_ratio"] <= 1
    assert start == len(seen)
    (table,) = diagnostics_tables(results)
    assert [c.header for c in table.columns] == ["task", "phase", "steps", "drop_control", "token_keep_ratio"]


def test_a_resumed_phase_keeps_the_diagnostics_of_its_steps_before_the_stop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stopped in the second epoch of task 1 and resumed from the checkpoint of its first: the same diagnostics as an
    uninterrupted run (the sums of the steps before the checkpoint travel in it)."""
    whole = train(tiny_config(*MEAT_RUN), tmp_path / "whole").method_diagnostics
    crash_and_resume(monkeypatch, MEAT_RUN, tmp_path / "cut", step=len_steps(whole, task=1) + 2)
    cut = json.loads((tmp_path / "cut" / "results.json").read_text())["method_diagnostics"]
    assert cut == whole


def len_steps(entries: list[dict], task: int) -> int:
    """The steps of the tasks before ``task`` plus half of ``task``'s: a stop in its second epoch."""
    return sum(e["steps"] for e in entries if e["task"] < task) + entries[task]["steps"] // 2
