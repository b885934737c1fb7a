"""Sweeps and scale-out through Hydra's engines: the joblib and submitit launchers, the Optuna sweeper with the
`objective` a job returns, and one run over two processes (torchrun, gloo) against a single process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from clbench.comparable import setting_name
from clbench.methods import BASELINES, PTM_METHODS
from conftest import TINY, clbench, said, tiny_fit, torchrun

SHORT = (*TINY, "data.num_tasks=2", "trainer.epochs=1")


def results(folder: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(folder.glob("[0-9]*/results.json"))]


@pytest.mark.parametrize(  # submitit's local launcher in test-all (14 s): the default suite keeps joblib's
    "launcher",
    [
        ("hydra/launcher=joblib", "hydra.launcher.n_jobs=2"),
        pytest.param(("hydra/launcher=submitit_local",), marks=pytest.mark.slow),
    ],
)
def test_parallel_launchers_run_every_job_grouped_in_wandb(tmp_path: Path, launcher: tuple[str, ...]) -> None:
    sweep = tmp_path / "sweep"
    out = clbench("-m", *SHORT, "logger.mode=offline", "seed=0,1", *launcher, f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    runs = results(sweep)
    assert [r["seed"] for r in runs] == [0, 1] and all(r["status"] == "finished" for r in runs)
    groups = {r["wandb"]["group"] for r in runs}  # one W&B group: the runs differ in their seed alone
    weights = runs[0]["backbone_config"]["weights_sha256"]
    assert groups == {setting_name(runs[0]["config"], weights)}
    assert groups.pop().startswith(f"finetune-{runs[0]['benchmark']}-vit_micro-")
    assert [f"seed={s}" in r["wandb"]["name"].split(",") for s, r in enumerate(runs)] == [True, True]  # by overrides
    assert len({r["wandb"]["id"] for r in runs}) == 2


def test_slurm_launcher_preset_composes_with_requeue_settings(tmp_path: Path) -> None:
    out = clbench(
        "hydra/launcher=slurm", "hydra.launcher.partition=gpu", "--cfg", "hydra", "-p", "hydra.launcher", cwd=tmp_path
    )
    assert out.returncode == 0, out.stderr[-3000:]
    launcher = yaml.safe_load(out.stdout)
    assert launcher["_target_"].endswith("SlurmLauncher") and launcher["partition"] == "gpu"
    assert launcher["max_num_timeout"] > 0 and launcher["signal_delay_s"] > 0 and launcher["gpus_per_node"] == 1


def test_optuna_search_optimises_the_objective_and_writes_the_best(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    out = clbench(
        "-m",
        "hparams_search=meat_optuna",
        *SHORT,
        "hydra.sweeper.n_trials=3",
        "objective=validation.til.final_acc",
        f"hydra.sweep.dir={sweep}",
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    runs = results(sweep)
    assert len(runs) == 3 and {r["method"] for r in runs} == {"meat"}
    best = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    values = [r["validation"]["metrics"]["til"]["final_acc"] for r in runs]  # selected on validation, not test
    assert [r["objective"] for r in runs] == [{"name": "validation.til.final_acc", "value": v} for v in values]
    assert all(r["config"]["data"]["val_fraction"] == 0.1 for r in runs)  # the preset's validation split
    assert best["best_value"] == pytest.approx(max(values))
    winner = runs[values.index(max(values))]["method_config"]
    assert best["best_params"]["method.lam"] == pytest.approx(winner["lam"])
    assert best["best_params"]["method.tau"] == pytest.approx(winner["tau"])
    assert len({r["method_config"]["lam"] for r in runs}) == 3  # the sampler really varied lam
    assert "setup plugin" not in out.stdout + out.stderr  # Optuna's alembic plugins say nothing to a user


# LwF's old heads start each task at the teacher's own outputs (TINY's data has no augmentation), so the
# distillation's gradient on them is zero up to rounding, and rounding differs between one process and two ranks
# (the same sums in another order). Adam divides a gradient by its own magnitude: it turns that rounding into
# lr-sized steps (measured: heads 1.5e-3 apart under AdamW, 7e-9 under SGD). The check of the reduction itself runs
# LwF and HiDe (its TII stage too) under SGD; under Adam the runs are as alike as the method's arithmetic lets them be.
EXACT_UNDER = {"lwf": ("trainer.optimizer=sgd",), "hide": ("trainer.optimizer=sgd", "method.tii.optimizer=sgd")}


@pytest.mark.parametrize(  # finetune in the default suite (20 s a method); the others in test-all
    "method",
    [
        "finetune",
        *(
            pytest.param(m, marks=pytest.mark.slow)
            for m in ("meat", "dualprompt", "coda_prompt", *BASELINES, *PTM_METHODS)
        ),
    ],
)
def test_two_gloo_processes_match_one_process_with_the_same_global_batch(tmp_path: Path, method: str) -> None:
    # batch 33 over 2 ranks: uneven shares (17/16), and a last batch the ranks split unevenly too
    overrides = (
        *TINY,
        *tiny_fit(f"method={method}"),
        f"method={method}",
        *EXACT_UNDER.get(method, ()),
        "trainer.batch_size=33",
        "logger.mode=offline",
    )
    one = clbench(*overrides, f"hydra.run.dir={tmp_path / 'one'}", cwd=tmp_path)
    assert one.returncode == 0, one.stderr[-3000:]
    two = torchrun(2, *overrides, f"hydra.run.dir={tmp_path / 'two'}", cwd=tmp_path)
    assert two.returncode == 0, said(two)
    a, b = (json.loads((tmp_path / d / "results.json").read_text()) for d in ("one", "two"))
    assert b["status"] == "finished"
    for s in ("til", "cil"):  # tolerance: one test image of a 20-image task (5 points); measured: identical
        for row_a, row_b in zip(a["acc_matrix"][s], b["acc_matrix"][s], strict=True):
            assert all(x == y or abs(x - y) <= 5.0 for x, y in zip(row_a, row_b, strict=True) if x is not None)
    # the method's saved state (MEAT: packed masks; heads) is the single process's: masks exactly, weights closely
    one_state, two_state = (load_file(tmp_path / d / "method_artifacts.safetensors") for d in ("one", "two"))
    assert one_state.keys() == two_state.keys()
    for key, value in one_state.items():
        if value.is_floating_point():
            assert torch.allclose(value, two_state[key], atol=1e-4), key
        else:
            assert torch.equal(value, two_state[key]), key
    # only rank 0 writes: one run folder, one W&B run, nothing in the working directory
    assert len(list((tmp_path / "two" / "wandb").glob("offline-run-*"))) == 1
    assert {p.name for p in tmp_path.iterdir()} - {"wandb_cache", "wandb_config"} == {"one", "two"}


def test_torchrun_refuses_a_multirun(tmp_path: Path) -> None:
    out = torchrun(2, "-m", *SHORT, "seed=0,1", cwd=tmp_path)
    assert out.returncode != 0 and "run sweeps with -m without torchrun" in out.stderr
