"""The `clbench` command as a user meets it: exit codes, one-paragraph errors, --help, multirun folders."""

from __future__ import annotations

import csv
import json
import statistics
import sys
from pathlib import Path

import pytest

from clbench.methods import METHODS as ALL_METHODS
from conftest import TINY, clbench, run_command


def test_multirun_gives_each_job_its_own_folder(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    out = clbench(
        "-m",
        *TINY,
        "data.num_tasks=2",
        "trainer.epochs=1",
        "trainer.warmup_epochs=1",
        "seed=0,1",
        f"hydra.sweep.dir={sweep}",
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    results = sorted(sweep.glob("*/results.json"))
    assert [p.parent.name for p in results] == ["0_seed=0", "1_seed=1"]  # named by what the sweep varies
    assert out.stderr.count("clbench: warning: trainer.warmup_epochs=1 covers every one of a task's") == 2
    assert [json.loads(p.read_text())["seed"] for p in results] == [0, 1]
    assert all(json.loads(p.read_text())["status"] == "finished" for p in results)
    assert "Metrics (%)" in out.stderr and "final acc" in out.stderr


def test_bad_value_exits_2_with_one_clear_message(tmp_path: Path) -> None:
    out = clbench("trainer.epochs=-3", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert out.returncode == 2
    assert "Invalid value for `trainer.epochs`: -3. Allowed: an integer >= 0." in out.stderr
    assert "Traceback" not in out.stderr
    assert not (tmp_path / "run" / "results.json").exists()


def test_unknown_method_lists_the_choices(tmp_path: Path) -> None:
    out = clbench("method=magic", cwd=tmp_path)
    assert out.returncode != 0
    assert "Could not find 'method/magic'" in out.stderr and "finetune" in out.stderr and "joint" in out.stderr


def test_missing_dataset_offline_names_the_path(tmp_path: Path) -> None:
    out = clbench("data=cifar100_10tasks", f"data.root={tmp_path / 'empty'}", "logger.mode=disabled", cwd=tmp_path)
    assert out.returncode == 2
    assert str(tmp_path / "empty" / "cifar-100-python") in out.stderr and "data.download=true" in out.stderr
    assert "Traceback" not in out.stderr


def test_help_lists_groups_and_examples(tmp_path: Path) -> None:
    out = clbench("--help", cwd=tmp_path)
    assert out.returncode == 0
    methods = next(line for line in out.stdout.splitlines() if line.startswith("method: "))
    assert set(methods.removeprefix("method: ").split(", ")) == set(ALL_METHODS)
    for text in (
        "== Config groups",
        "data: ",
        "backbone: ",
        "Examples:",
        "trainer.device=auto|cpu|cuda",
    ):
        assert text in out.stdout, text


def test_clbench_eval_reproduces_a_saved_run(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    out = clbench(
        *TINY, "data.num_tasks=2", "trainer.epochs=1", "method=piggyback", f"hydra.run.dir={run_dir}", cwd=tmp_path
    )
    assert out.returncode == 0, out.stderr[-3000:]
    again = run_command(sys.executable, "-m", "clbench.reevaluate", str(run_dir), "--json", cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    saved = json.loads((run_dir / "results.json").read_text())["acc_matrix"]
    assert json.loads(again.stdout) == {s: saved[s][-1] for s in ("til", "cil")}
    missing = run_command(sys.executable, "-m", "clbench.reevaluate", str(tmp_path), cwd=tmp_path)
    assert missing.returncode == 2 and "not a clbench run folder" in missing.stderr


def test_report_over_a_multirun_of_two_methods_and_two_seeds(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    out = clbench(
        "-m",
        *TINY,
        "data.num_tasks=2",
        "trainer.epochs=1",
        "method=finetune,joint",
        "seed=0,1",
        f"hydra.sweep.dir={sweep}",
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    failed = sweep / "extra" / "results.json"  # a run that did not finish is listed, not averaged
    failed.parent.mkdir()
    failed.write_text(json.dumps({"status": "failed"}))
    report = run_command(
        sys.executable, "-m", "clbench.report", str(sweep), "--out", str(tmp_path / "report"), cwd=tmp_path
    )
    assert report.returncode == 0, report.stderr[-3000:]
    runs = [json.loads(p.read_text()) for p in sweep.glob("[0-9]*/results.json")]
    rows = list(csv.DictReader((tmp_path / "report.csv").open()))
    assert sorted(r["method"] for r in rows) == ["finetune", "joint"] and all(r["runs"] == "2" for r in rows)
    for row in rows:
        values = [r["metrics"]["cil"]["final_acc"] for r in runs if r["method"] == row["method"]]
        assert float(row["cil_final_acc_mean"]) == pytest.approx(statistics.fmean(values), abs=1e-4)
        assert float(row["cil_final_acc_std"]) == pytest.approx(statistics.stdev(values), abs=1e-4)
    assert "did not finish" in report.stdout and "extra" in report.stdout
    assert "\\toprule" in (tmp_path / "report.tex").read_text()
    assert (tmp_path / "report.png").read_bytes()[:4] == b"\x89PNG"


def test_an_unwritable_output_folder_is_refused_before_hydra_creates_it(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("in the way")
    for args in (("hydra.run.dir=file/run",), ("-m", "seed=0,1", "hydra.sweep.dir=file/sweep")):
        out = clbench(*args, *TINY, cwd=tmp_path)
        assert out.returncode == 2, out.stderr[-2000:]
        assert "Cannot write in the output folder file/" in out.stderr and "Traceback" not in out.stderr


def test_a_diverging_loss_ends_with_one_paragraph_naming_where(tmp_path: Path) -> None:
    out = clbench(*TINY, "trainer.lr=1e30", "trainer.log_every=1", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "is nan at task 0 (train phase), epoch 0, step" in out.stderr and "lower trainer.lr" in out.stderr
    assert json.loads((tmp_path / "run" / "results.json").read_text())["status"] == "failed"


@pytest.mark.parametrize(
    ("overrides", "hint"),
    [
        (("method=meat", "method.lamda=0.5"), "`method.lamda` is not a key of method=meat: did you mean `method.lam`?"),
        (  # the method chosen through a preset
            ("experiment=l2p_cifar100_paper", "method.pool_sise=5"),
            "`method.pool_sise` is not a key of the chosen method: did you mean `method.pool_size`?",
        ),
        (("method=meta",), "no method config `meta`: did you mean `method=meat`? The method configs: adapter, apd,"),
        pytest.param(  # the case below without a method (4 s each, a process: this one in make test-all)
            ("method=meat", "lam=0.5"),
            "`lam` is not a top-level key: did you mean `method.lam`?",
            marks=pytest.mark.slow,
        ),
        (("lam=0.5",), "`lam` is not a top-level key: did you mean `method.lam` (a key of method=ewc, method=lwf,"),
        (("epochs=3",), "`epochs` is not a top-level key: did you mean `trainer.epochs`?"),
    ],
)
def test_a_mistyped_key_or_option_gets_clbenchs_closest_instead_of_hydras_advice(
    tmp_path: Path, overrides: tuple[str, ...], hint: str
) -> None:
    """clbench's reading comes first, alone: not Hydra's "To append to your config use +..." (clbench's schemas
    refuse unknown keys) nor a bare list of options."""
    out = clbench(*overrides, f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert out.returncode == 2 and out.stderr.startswith(f"clbench: {hint}"), out.stderr[-2000:]
    assert "To append" not in out.stderr and "HYDRA_FULL_ERROR" not in out.stderr


def test_the_embedded_default_prints_the_weights_it_loads_once(tmp_path: Path) -> None:
    out = clbench(
        "data.num_tasks=1", "trainer.epochs=0", "logger.mode=disabled", f"hydra.run.dir={tmp_path}", cwd=tmp_path
    )
    assert out.returncode == 0, out.stderr[-3000:]
    said = out.stdout + out.stderr + (tmp_path / "clbench.log").read_text()
    assert "from checkpoint" not in said  # timm's own lines: the backbone line names the file
    assert out.stderr.count("vit_micro.glyphs.safetensors") == 1


def test_a_run_of_fewer_tasks_is_named_by_what_it_ran(tmp_path: Path) -> None:
    """`data.num_tasks=3` of a 5-task benchmark: the folder, results.json and the figures' titles say the first 3."""
    from clbench.results import Results
    from clbench.tracking import on_what

    out = clbench(*TINY, "trainer.epochs=1", "trainer.eval_random_init=false", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    (folder,) = (tmp_path / "outputs").glob("*/*")
    assert folder.name.endswith("_finetune_synthetic_tiny_first3")
    results = json.loads((folder / "results.json").read_text())
    assert results["benchmark"] == "synthetic_tiny_first3" and len(results["tasks"]) == 3
    assert on_what(Results({"method": "finetune", "benchmark": results["benchmark"]}, [])) == (
        "finetune on synthetic_tiny_first3"
    )
