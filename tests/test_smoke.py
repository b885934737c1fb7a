"""A preset without a GPU: `smoke=true` takes a run end to end on a few images and steps, marked and never a result;
`clbench check` says whether a run could start, and does nothing else."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from clbench import smoke
from clbench.data import build_benchmark
from clbench.loop import step as step_module
from clbench.loop import train
from clbench.report import read_run
from conftest import TINY, clbench, tiny_config

SMOKE = ("method=meat", "smoke=true", "trainer.epochs=3")


def test_smoke_keeps_two_training_images_of_every_class_and_a_test_image_of_every_task() -> None:
    bench = build_benchmark(tiny_config("data.val_fraction=0.5").data)
    small = smoke.sampled(bench)
    assert small.tasks == bench.tasks
    for a, b in zip(bench.train, small.train, strict=True):
        for label in a.y.unique().tolist():
            rows = (a.y == label).nonzero().flatten()[:2]
            assert torch.equal(b.x[b.y == label], a.x[rows])
    for full, kept in ((bench.test, small.test), (bench.validation, small.validation)):
        assert [(torch.equal(b.x, a.x[:1]), torch.equal(b.y, a.y[:1])) for a, b in zip(full, kept, strict=True)] == [
            (True, True)
        ] * 3


def test_a_smoke_run_takes_one_step_a_phase_and_says_it_is_not_a_result(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """MEAT, 3 epochs a task: one step of two images in each task's phase; results.json says smoke with what it kept
    (the config its batch of 2); the report lists it apart."""
    steps: list[int] = []
    real = step_module.train_step

    def counted(*args: object, **kwargs: object) -> object:
        steps.append(len(args[4]))  # the batch's labels: its images
        return real(*args, **kwargs)

    monkeypatch.setattr(step_module, "train_step", counted)
    train(tiny_config(*SMOKE), tmp_path / "run")
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert steps == [smoke.BATCH_SIZE] * 3 and [e["steps"] for e in results["method_diagnostics"]] == [1, 1, 1]
    assert results["smoke"] == smoke.described() and results["config"]["smoke"] is True
    assert results["config"]["trainer"]["batch_size"] == smoke.BATCH_SIZE and results["status"] == "finished"
    listed = read_run(tmp_path / "run" / "results.json")
    assert not isinstance(listed, dict) and "a smoke run" in listed.reason and "not a result" in listed.reason


@pytest.mark.slow  # a minute: ViT-B/16 at 224 px on the CPU through every task of L2P Table 1's ER row
def test_a_paper_preset_goes_end_to_end_as_a_smoke_run_on_the_cpu(tmp_path: Path) -> None:
    out = clbench(
        "experiment=l2p_table1_er_10",
        "data=synthetic_cifar100",
        "backbone.pretrained=false",
        "smoke=true",
        "logger.mode=disabled",
        f"hydra.run.dir={tmp_path / 'run'}",
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert results["status"] == "finished" and results["smoke"] and len(results["acc_matrix"]["cil"]) == 10
    assert "SMOKE RUN" in out.stderr


def test_check_reports_what_is_missing_and_runs_nothing(tmp_path: Path) -> None:
    """A paper preset without its data or weights: both named, exit 2; the embedded default: ready, exit 0; neither
    writes a folder."""
    missing = clbench("check", "experiment=l2p_table1_er_10", f"data.root={tmp_path / 'none'}", cwd=tmp_path)
    assert missing.returncode == 2, missing.stderr[-2000:]
    assert "  config   valid: er on cifar100_10tasks (10 tasks), vit_base_patch16_224" in missing.stdout
    assert "  data     MISSING: cifar100: CIFAR-100" in missing.stdout and str(tmp_path / "none") in missing.stdout
    assert "  weights  MISSING: Pretrained weights vit_base_patch16_224.orig_in21k" in missing.stdout
    assert "Not ready: 2 missing" in missing.stdout
    ready = clbench("check", *TINY, cwd=tmp_path)
    assert ready.returncode == 0 and "Ready: the run can start here." in ready.stdout, ready.stderr[-2000:]
    assert "  weights  ready: none: vit_micro starts from a random initialisation" in ready.stdout
    refused = clbench("check", "trainer.epochs=-1", cwd=tmp_path)
    assert refused.returncode == 2 and "Invalid value for `trainer.epochs`" in refused.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []
