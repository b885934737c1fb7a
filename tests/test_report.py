"""`clbench-report` over hand-made results.json files: one row per setting, never averaging different configs."""

from __future__ import annotations

import copy
import csv
import json
import math
import statistics
from pathlib import Path
from typing import Any

import pytest

from clbench.metrics import summary
from clbench.report import main

CONFIG: dict[str, Any] = {
    "method": {"_target_": "clbench.methods.finetune.Finetune", "loss_scope": "seen"},
    "data": {"name": "synthetic_tiny", "num_tasks": 2, "root": "data"},
    "backbone": {"name": "vit_micro", "pretrained": False},
    "trainer": {"lr": 0.001, "epochs": 1, "log_every": 10, "device": "cpu"},
    "logger": {"mode": "disabled", "project": "clbench"},
    "seed": 0,
    "resume": False,
    "objective": "cil.final_acc",
}
METRICS = ("final_acc", "avg_incremental_acc", "forgetting", "bwt", "fwt")


def write_run(
    folder: Path,
    *,
    seed: int = 0,
    changes: dict[str, Any] | None = None,
    values: dict[str, Any] | None = None,
    **top: Any,
) -> dict[str, Any]:
    """Write ``folder/results.json`` of a finished run of two tasks: CONFIG with dotted ``changes``, ``top`` over the
    top-level keys, and metrics that are what its matrices give (as clbench writes them). Each scenario's matrix is
    [[80 + seed, -], [60 + seed, 40 + seed]] over tasks of 1 and 3 test images, made to give ``values``
    (``{"cil.final_acc": 55.0}``): final_acc v makes the last row [v, v]; final_acc_micro v (with final_acc 50) the last
    row [150 - 2v, 2v - 50]; bwt v sets R[1][0] = R[0][0] + v; fwt v sets the accuracy on task 1 before training it to
    20 + v over a random-init accuracy of 20 (fwt None: no random-init accuracy). A value that is not a number is
    written into the metrics as it is (a damaged file), NaN too. Returns what it wrote."""
    config = copy.deepcopy(CONFIG) | {"seed": seed}
    for dotted, value in (changes or {}).items():
        *parents, leaf = dotted.split(".")
        node = config
        for parent in parents:
            node = node[parent]
        node[leaf] = value
    matrix = {s: [[80.0 + seed, None], [60.0 + seed, 40.0 + seed]] for s in ("til", "cil")}
    before = {s: [None, 30.0] for s in ("til", "cil")}
    random_init: dict[str, list[float] | None] = {s: [10.0, 20.0] for s in ("til", "cil")}
    damaged = {}
    for dotted, value in (values or {}).items():
        scenario, metric = dotted.split(".")
        rows = matrix[scenario]
        if not isinstance(value, float | type(None)) or (value is not None and not math.isfinite(value)):
            damaged[(scenario, metric)] = value
        elif metric == "final_acc":
            rows[1] = [value, value]
        elif metric == "final_acc_micro":  # tasks of 1 and 3 test images, final_acc 50
            rows[1] = [150.0 - 2 * value, 2 * value - 50.0]
        elif metric == "bwt":
            rows[1][0] = rows[0][0] + value
        elif metric == "fwt" and value is None:
            random_init[scenario] = None
        elif metric == "fwt":
            before[scenario], random_init[scenario] = [None, 20.0 + value], [10.0, 20.0]
    sizes = [1, 3]  # each task's test images
    metrics = {s: summary(matrix[s], before[s], random_init[s], sizes) for s in ("til", "cil")}
    for (scenario, metric), value in damaged.items():
        metrics[scenario][metric] = value
    run = {
        "method": "finetune",
        "backbone": "vit_micro",
        "benchmark": "synthetic_tiny",
        "seed": seed,
        "status": "finished",
        "config": config,
        "tasks": [{"id": t, "classes": [2 * t, 2 * t + 1], "test_images": n} for t, n in enumerate(sizes)],
        "acc_matrix": matrix,
        "before_task_acc": before,
        "random_init_acc": random_init,
        "metrics": metrics,
    } | top
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "results.json").write_text(json.dumps(run))
    return run


def report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[str, list[dict[str, str]]]:
    """Run the report over tmp_path/sweep: its Markdown output and the CSV rows."""
    main([str(tmp_path / "sweep"), "--out", str(tmp_path / "report")])
    rows = list(csv.DictReader((tmp_path / "report.csv").open()))
    return capsys.readouterr().out, rows


def markdown_rows(text: str) -> list[dict[str, str]]:
    """The Markdown table's rows as {header: cell}."""
    lines = [line.strip("|").split(" | ") for line in text.splitlines() if line.startswith("| ")]
    header = [h.strip() for h in lines[0]]
    return [dict(zip(header, [c.strip() for c in cells], strict=True)) for cells in lines[1:]]


def test_two_learning_rates_by_two_seeds_give_two_rows_of_two_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    final = {(0.001, 0): 60.0, (0.001, 1): 64.0, (0.0001, 0): 40.0, (0.0001, 1): 47.0}
    for job, ((lr, seed), value) in enumerate(final.items()):
        write_run(tmp_path / "sweep" / str(job), seed=seed, changes={"trainer.lr": lr}, values={"cil.final_acc": value})
    out, rows = report(tmp_path, capsys)
    assert len(rows) == 2 and all(r["runs"] == "2" for r in rows)
    for lr in (0.001, 0.0001):
        (row,) = [r for r in rows if r["setting"] == f"lr={lr:g}"]
        values = [v for (rate, _), v in final.items() if rate == lr]
        assert float(row["cil_final_acc_mean"]) == pytest.approx(statistics.fmean(values), abs=1e-4)
        assert float(row["cil_final_acc_std"]) == pytest.approx(statistics.stdev(values), abs=1e-4)
    assert not any("seed" in r["setting"] for r in rows)
    table = markdown_rows(out)
    assert [r["setting"] for r in table] == ["lr=0.0001", "lr=0.001"]
    assert table[0]["CIL final"] == f"{statistics.fmean([40.0, 47.0]):.2f} ± {statistics.stdev([40.0, 47.0]):.2f}"


def test_one_run_shows_its_value_alone(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_run(tmp_path / "sweep" / "0", values={"cil.final_acc": 55.5})
    out, rows = report(tmp_path, capsys)
    (row,) = markdown_rows(out)
    assert row["CIL final"] == "55.50" and row["runs"] == "1" and row["setting"] == "-"
    assert "±" not in out
    assert rows[0]["cil_final_acc_std"] == "" and rows[0]["setting"] == ""


def test_bwt_and_fwt_columns_average_the_runs_that_measured_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bwt, til_fwt = [-3.0, -6.0], [10.0, None]
    for seed in (0, 1):
        values = {"cil.bwt": bwt[seed], "cil.fwt": None, "til.fwt": til_fwt[seed]}
        write_run(tmp_path / "sweep" / str(seed), seed=seed, values=values)
    out, rows = report(tmp_path, capsys)
    (row,) = rows
    assert float(row["cil_bwt_mean"]) == pytest.approx(statistics.fmean(bwt), abs=1e-4)
    assert float(row["cil_bwt_std"]) == pytest.approx(statistics.stdev(bwt), abs=1e-4)
    assert row["cil_fwt_mean"] == row["cil_fwt_std"] == ""
    assert float(row["til_fwt_mean"]) == pytest.approx(10.0) and row["til_fwt_std"] == ""
    (cells,) = markdown_rows(out)
    assert cells["CIL FWT"] == "-" and cells["TIL FWT"] == "10.00"
    assert cells["CIL BWT"] == f"{statistics.fmean(bwt):.2f} ± {statistics.stdev(bwt):.2f}"


def test_failed_jobs_are_listed_with_their_overrides_and_last_log_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sweep = tmp_path / "sweep"
    write_run(sweep / "0", values={"cil.final_acc": 70.0})
    crashed = sweep / "1"
    (crashed / ".hydra").mkdir(parents=True)
    (crashed / ".hydra" / "overrides.yaml").write_text("- trainer.lr=0.0001\n- seed=1\n")
    (crashed / "clbench.log").write_text(
        "[INFO] - task 1/2\nTraceback (most recent call last):\nRuntimeError: boom\n\n"
    )
    (sweep / "2" / ".hydra").mkdir(parents=True)
    write_run(sweep / "3", seed=3, status="failed", failure="ValueError: bad value\nsecond line")
    out, rows = report(tmp_path, capsys)
    assert len(rows) == 1 and rows[0]["runs"] == "1" and float(rows[0]["cil_final_acc_mean"]) == 70.0
    listed = out.split("did not finish")[1]
    (line,) = [x for x in listed.splitlines() if str(crashed) in x]
    assert "no results.json" in line and "trainer.lr=0.0001 seed=1" in line and line.endswith("RuntimeError: boom")
    assert f"{sweep / '2'}: no results.json; last log line: no log" in listed
    assert f"{sweep / '3'}: failed: ValueError: bad value" in listed and "second line" not in listed


def test_an_old_results_json_without_config_still_reports_with_png_and_pdf(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for seed in (0, 1):
        folder = tmp_path / "sweep" / str(seed)
        run = write_run(folder, seed=seed, values={"cil.final_acc": 50.0 + seed})
        del run["config"]
        run["method_config"] = {"loss_scope": "seen"}
        run["backbone_config"] = {"name": "vit_micro", "weights_file": f"/cache/{seed}.pth", "weights_sha256": "ab"}
        (folder / "results.json").write_text(json.dumps(run))
    _, rows = report(tmp_path, capsys)
    (row,) = rows
    assert row["runs"] == "2" and float(row["cil_final_acc_mean"]) == pytest.approx(50.5)
    assert (tmp_path / "report.png").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "report.pdf").read_bytes()[:4] == b"%PDF"
    assert (tmp_path / "report.md").read_text().startswith("| method |")


def test_logger_and_log_every_do_not_set_runs_apart(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_run(tmp_path / "sweep" / "0", seed=0, values={"til.final_acc": 90.0})
    changes = {"logger.project": "other", "logger.mode": "offline", "trainer.log_every": 1}
    write_run(tmp_path / "sweep" / "1", seed=1, changes=changes, values={"til.final_acc": 80.0})
    _, rows = report(tmp_path, capsys)
    (row,) = rows
    assert row["runs"] == "2" and row["setting"] == ""
    assert float(row["til_final_acc_mean"]) == pytest.approx(statistics.fmean([90.0, 80.0]))


def test_each_row_is_labelled_by_every_key_it_differs_in_and_latex_escapes_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_run(tmp_path / "sweep" / "0")
    write_run(tmp_path / "sweep" / "1", changes={"method.loss_scope": "all", "trainer.epochs": 5})
    write_run(tmp_path / "sweep" / "2", method="joint", changes={"method._target_": "clbench.methods.joint.Joint"})
    _, rows = report(tmp_path, capsys)
    assert [(r["method"], r["setting"]) for r in rows] == [
        ("finetune", "loss_scope=all, epochs=5"),
        ("finetune", "loss_scope=seen, epochs=1"),
        ("joint", ""),
    ]
    tex = (tmp_path / "report.tex").read_text()
    assert r"loss\_scope=all, epochs=5" in tex and r"\toprule" in tex and r"TIL BWT" in tex


def test_reconstructed_methods_are_marked_in_every_output(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """KSM and TFM are reconstructions (results.json `reconstructed: true`); the report said so nowhere."""
    from clbench.report import curve_label, table_rows

    write_run(tmp_path / "sweep" / "0", reconstructed=False)
    write_run(tmp_path / "sweep" / "1", method="ksm", reconstructed=True, changes={"method._target_": "k.KSM"})
    text, rows = report(tmp_path, capsys)
    assert [(r["method"], r["reconstructed"]) for r in rows] == [("finetune", "False"), ("ksm", "True")]
    assert [r["method"] for r in markdown_rows(text)] == ["finetune", "ksm †"]
    assert "† reconstructed method (results.json `reconstructed: true`)" in text
    tex = (tmp_path / "report.tex").read_text()
    assert r"ksm $^\dagger$ &" in tex and r"finetune &" in tex and r"{\footnotesize $^\dagger$ reconstructed" in tex
    table = table_rows([json.loads((tmp_path / "sweep" / f"{i}" / "results.json").read_text()) for i in (0, 1)])
    assert [curve_label(r, table) for r in table] == ["finetune", "ksm (reconstructed)"]


def test_nothing_to_report_exits_2_and_help_explains_the_rows(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([str(tmp_path)])
    assert exit_info.value.code == 2 and "no results.json" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "except for the seed" in capsys.readouterr().out


def test_a_run_found_twice_counts_once_and_the_duplicate_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two multirun folders holding seed 0 of one setting (they differ only in log_every): seeds 0 and 1 are two
    runs, not three, and the std is theirs."""
    write_run(tmp_path / "sweep" / "mr1" / "0", seed=0, values={"cil.final_acc": 60.0})
    write_run(tmp_path / "sweep" / "mr1" / "1", seed=1, values={"cil.final_acc": 64.0})
    write_run(
        tmp_path / "sweep" / "mr2" / "0", seed=0, changes={"trainer.log_every": 5}, values={"cil.final_acc": 60.0}
    )
    out, rows = report(tmp_path, capsys)
    (row,) = rows
    assert row["runs"] == "2" and float(row["cil_final_acc_std"]) == pytest.approx(
        statistics.stdev([60.0, 64.0]), abs=1e-4
    )
    assert "mr2/0" in out and "duplicate of" in out and "seed 0" in out


def damaged_sweep(sweep: Path) -> dict[str, str]:
    """Two sound runs (seeds 0, 1) of the row preset l2p_table1_ft_seq, and beside them runs that must not be averaged,
    each with the words its line must say: a binary file, a NaN metric, a metric written as a string, a final accuracy
    of 250 (its matrix unchanged), and one whose final accuracy its own matrix contradicts."""
    for seed in (0, 1):
        write_run(sweep / str(seed), seed=seed, values={"cil.final_acc": 60.0 + seed})
    (sweep / "2").mkdir()
    (sweep / "2" / "results.json").write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff\xfe")
    write_run(sweep / "3", seed=3, values={"cil.final_acc": float("nan")})
    write_run(sweep / "4", seed=4, values={"til.forgetting": "12.5"})
    for folder, value in (("5", 250.0), ("6", 55.0)):
        run = write_run(sweep / folder, seed=int(folder))
        run["metrics"]["cil"]["final_acc"] = value  # the last row, [60 + seed, 40 + seed], averages 50 + seed
        (sweep / folder / "results.json").write_text(json.dumps(run))
    for job in sweep.iterdir():
        (job / ".hydra").mkdir()
        (job / ".hydra" / "overrides.yaml").write_text(f"- experiment=l2p_table1_ft_seq\n- seed={job.name}\n")
    return {
        "2": "unreadable results.json: UnicodeDecodeError",
        "3": "metrics.cil.final_acc is nan, not a number",
        "4": "metrics.til.forgetting is '12.5', not a number",
        "5": "metrics.cil.final_acc is 250.0, outside [0, 100]",
        "6": "metrics.cil.final_acc is 55.0, but its acc_matrix gives 56.0000",
    }


@pytest.mark.parametrize("table", [None, "l2p_table1"])
def test_a_damaged_or_contradicted_results_json_is_named_and_the_rest_reported(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], table: str | None
) -> None:
    """Each bad file gets a line naming its folder, results.json and what is wrong; the two sound runs are the row."""
    sweep = tmp_path / "sweep"
    said = damaged_sweep(sweep)
    main([str(sweep), "--out", str(tmp_path / "out"), *(["--table", table] if table else [])])
    out = capsys.readouterr().out
    for job, why in said.items():
        (line,) = [x for x in out.splitlines() if x.startswith(f"- {sweep / job} ")]
        assert "results.json" in line and why in line, line
    rows = list(csv.DictReader((tmp_path / "out.csv").open()))
    if table is None:
        (row,) = rows
        assert row["runs"] == "2" and float(row["cil_final_acc_mean"]) == pytest.approx(60.5)
    else:
        (row,) = [r for r in rows if r["preset"] == "l2p_table1_ft_seq"]
        assert row["runs"] == "2" and float(row["avg_acc_mean"]) == pytest.approx(60.5)


def test_a_paper_table_lists_a_run_without_its_config_apart(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Without `config` a run's row cannot be checked: --table names it and leaves it out; the plain report, which
    groups older files by what their header tells, still averages it."""
    sweep = tmp_path / "sweep"
    for seed in (0, 1):
        run = write_run(sweep / str(seed), seed=seed, values={"cil.final_acc": 60.0 + seed})
        (sweep / str(seed) / ".hydra").mkdir()
        (sweep / str(seed) / ".hydra" / "overrides.yaml").write_text(f"- experiment=l2p_table1_ft_seq\n- seed={seed}\n")
    del run["config"]
    (sweep / "1" / "results.json").write_text(json.dumps(run))
    main([str(sweep), "--table", "l2p_table1", "--out", str(tmp_path / "table")])
    out = capsys.readouterr().out
    assert f"- {sweep / '1'}: results.json has no `config`" in out
    (row,) = [r for r in csv.DictReader((tmp_path / "table.csv").open()) if r["preset"] == "l2p_table1_ft_seq"]
    assert row["runs"] == "1" and float(row["avg_acc_mean"]) == pytest.approx(60.0)


def test_without_out_the_report_goes_beside_the_runs_it_reads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for job in ("0", "1"):
        write_run(tmp_path / "sweep" / job, seed=int(job))
    monkeypatch.chdir(tmp_path / "sweep" / "0")  # a working folder that is not where the report belongs
    main([str(tmp_path / "sweep")])
    assert (tmp_path / "sweep" / "report.md").is_file() and (tmp_path / "sweep" / "report.csv").is_file()
    main([str(tmp_path / "sweep" / "0" / "results.json"), str(tmp_path / "sweep" / "1")])  # their common folder
    main([str(tmp_path / "sweep"), "--table", "l2p_table1"])  # a paper table's report is named after it
    assert (tmp_path / "sweep" / "l2p_table1.md").is_file()
    assert sorted(p.name for p in (tmp_path / "sweep" / "0").iterdir()) == ["results.json"]
    assert f"written: {tmp_path / 'sweep' / 'l2p_table1.md'}" in capsys.readouterr().err


def test_a_report_that_cannot_be_written_is_refused_before_reading(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_run(tmp_path / "sweep" / "0")
    with pytest.raises(SystemExit) as exit_:
        main([str(tmp_path / "sweep"), "--out", "/proc/nope/rep"])
    assert exit_.value.code == 2
    assert "Cannot write in the output folder /proc/nope" in capsys.readouterr().err


SMALL = (  # the embedded default's benchmark (a table's protocol) on a one-block ViT, one epoch a task: seconds a run
    "backbone.pretrained=false",
    "backbone.img_size=16",
    "backbone.kwargs.depth=1",
    "backbone.kwargs.embed_dim=32",
    "backbone.kwargs.num_heads=2",
    "trainer.epochs=1",
    "trainer.eval_random_init=false",
)


def test_the_method_tables_are_measured_and_written_between_their_markers(tmp_path: Path) -> None:
    """`make table` on one method (shrunk to seconds a run by --set): both tables rewritten from its results.json,
    the text around them kept, and each row naming the overrides that made it."""
    from clbench.method_table import main as table

    readme = tmp_path / "README.md"
    blocks = [f"<!-- method-table: {s} -->\nold\n<!-- /method-table -->" for s in ("5 tasks", "3 tasks")]
    readme.write_text("intro\n" + "\nbetween\n".join(blocks) + "\nend\n")
    table(["--readme", str(readme), "--methods", "finetune", "--set", *SMALL])
    text = readme.read_text()
    assert text.startswith("intro\n") and "\nbetween\n" in text and text.endswith("end\n") and "old" not in text
    rows = [line for line in text.splitlines() if line.startswith("| finetune ")]
    assert len(rows) == 2 and all(len(r.split("|")) == 8 for r in rows) and "Measured by `make table`" in text
    marks = ", ".join(sorted(SMALL))
    assert all(r.startswith(f"| finetune ({marks}) |") for r in rows)
    with pytest.raises(SystemExit) as refused:  # an unknown method is refused before any run, the README kept
        table(["--readme", str(readme), "--methods", "nope"])
    assert refused.value.code == 2 and readme.read_text() == text


@pytest.mark.parametrize(
    ("overrides", "said"),
    [
        (["method=finetune", "trainer.epochs=1"], "would measure method=finetune in the er row"),
        (["data.num_tasks=2", "trainer.epochs=1"], "the 5 tasks table measures (data.num_tasks: null -> 2)"),
        (
            ["data=synthetic_tiny"],
            "changes what the 5 tasks table measures (data.name: digits_5tasks -> synthetic_tiny",
        ),
        (["data.class_order_seed=7"], "(data.class_order_seed: 1993 -> 7)"),
    ],
)
def test_make_table_refuses_overrides_that_would_put_another_run_in_a_row(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, overrides: list[str], said: str
) -> None:
    """Another method's numbers in a method's row, or another benchmark's (task count, class order) in a table: refused
    before any run, the README untouched."""
    from clbench import method_table

    readme = tmp_path / "README.md"
    before = table_readme(readme, ("er",))
    monkeypatch.setattr(method_table, "measure", lambda *a: pytest.fail("a run started"))
    with pytest.raises(SystemExit) as refused:
        method_table.main(["--readme", str(readme), "--methods", "er", "--set", *overrides])
    assert str(refused.value.code).startswith("clbench-table: --set ") and said in str(refused.value.code)
    assert readme.read_bytes() == before


def test_make_table_marks_a_row_measured_with_overrides(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--set trainer.epochs=1 memory.per_class=5`: the er rows carry those overrides beside the method's name."""
    from clbench import method_table

    readme = tmp_path / "README.md"
    table_readme(readme, ("er", "derpp"))
    monkeypatch.setattr(method_table, "measure", lambda m, o, f, e: {"method": m, "values": (9.0, 1.0, 8.0, 2.0, 3)})
    method_table.main(["--readme", str(readme), "--methods", "er", "--set", "trainer.epochs=1", "memory.per_class=5"])
    lines = readme.read_text().splitlines()
    assert lines.count("| er (memory.per_class=5, trainer.epochs=1) | 9.0 | 1.0 | 8.0 | 2.0 | 3 |") == 2
    assert lines.count("| derpp | 1.0 | 2.0 | 3.0 | 4.0 | 5 |") == 2


def test_make_table_writes_no_row_from_a_run_that_is_not_the_rows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A child run whose results.json is another method's, or another config's, than its row's: no row from it."""
    import subprocess

    from clbench import method_table

    rows = method_table.check_overrides(["er", "finetune", "classifier"], [])
    expected = rows["5 tasks/er"]["config"]

    def child(wrote: dict[str, Any]) -> Any:
        def run(command: list[str], **kwargs: Any) -> subprocess.CompletedProcess:
            folder = Path(command[-1].split("=", 1)[1])
            folder.mkdir(parents=True)
            metrics = {s: {"final_acc": 50.0, "forgetting": 1.0} for s in ("til", "cil")}
            (folder / "results.json").write_text(json.dumps({"status": "finished", "metrics": metrics, **wrote}))
            return subprocess.CompletedProcess(command, 0, "", "")

        return run

    finetune = {"method": "finetune", "benchmark": "digits_5tasks", "config": rows["5 tasks/finetune"]["config"]}
    monkeypatch.setattr(method_table.subprocess, "run", child(finetune))
    row = method_table.measure("er", (), tmp_path / "a", expected)
    assert "values" not in row and "measured clbench.methods.finetune.Finetune, not the er row's" in row["error"]
    other = copy.deepcopy(expected)
    other["trainer"]["epochs"] = 1
    monkeypatch.setattr(
        method_table.subprocess, "run", child({"method": "er", "benchmark": "digits_5tasks", "config": other})
    )
    row = method_table.measure("er", (), tmp_path / "b", expected)
    assert "values" not in row and "config is not its row's (trainer.epochs)" in row["error"]
    fewer = {"method": "er", "benchmark": "digits_5tasks_first3", "config": expected}
    monkeypatch.setattr(method_table.subprocess, "run", child(fewer))
    row = method_table.measure("er", (), tmp_path / "c", expected)
    assert "values" not in row and "measured digits_5tasks_first3, not the table's digits_5tasks" in row["error"]
    classifier = rows["5 tasks/classifier"]["config"]  # finetune's class: results.json names its method finetune
    monkeypatch.setattr(method_table.subprocess, "run", child({**finetune, "config": classifier}))
    assert "values" in method_table.measure("classifier", (), tmp_path / "d", classifier)


def table_readme(path: Path, methods: tuple[str, ...]) -> bytes:
    """A README whose two method tables hold a row of made-up numbers for each of ``methods``."""
    rows = "".join(f"| {m} | 1.0 | 2.0 | 3.0 | 4.0 | 5 |\n" for m in methods)
    head = "| method | TIL final | TIL forgetting | CIL final | CIL forgetting | seconds |\n|---|---|---|---|---|---|\n"
    blocks = [f"<!-- method-table: {s} -->\n{head}{rows}\nMeasured before.\n<!-- /method-table -->" for s in SETTINGS]
    path.write_text("intro\n" + "\n".join(blocks) + "\nend\n")
    return path.read_bytes()


SETTINGS = ("5 tasks", "3 tasks")


def test_make_table_writes_only_finished_rows_and_keeps_every_other(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--methods simplecil` rewrites simplecil's rows and keeps the others; a failed or interrupted run (which exits
    0 with the tasks it trained) writes no row; without a finished run the README is not written at all."""
    from clbench import method_table
    from clbench.methods import METHODS

    readme = tmp_path / "README.md"
    before = table_readme(readme, METHODS)
    outcome = {"simplecil": {"values": (90.0, 0.0, 80.0, 5.0, 7.0)}, "finetune": {"error": "ConfigError"}}
    monkeypatch.setattr(method_table, "measure", lambda m, o, f, e: {"method": m, **outcome[m]})
    method_table.main(["--readme", str(readme), "--methods", "simplecil"])
    lines = readme.read_text().splitlines()
    assert lines.count("| simplecil | 90.0 | 0.0 | 80.0 | 5.0 | 7 |") == 2
    assert sum(line.startswith("| ") for line in lines) == 2 * (len(METHODS) + 1)  # every row kept, the header
    assert "measured simplecil" in capsys.readouterr().err
    readme.write_bytes(before)
    with pytest.raises(SystemExit, match="nothing written"):
        method_table.main(["--readme", str(readme), "--methods", "finetune"])
    assert readme.read_bytes() == before


def test_an_interrupted_run_is_no_row_and_stops_the_table(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A clbench child stopped by SIGINT exits 0 with results.json `interrupted` and the numbers of the tasks it
    trained (4 of 5): they must not become the method's 5-task row, and the table stops there."""
    import subprocess

    from clbench import method_table

    calls = []

    def child(command: list[str], **kwargs: Any) -> subprocess.CompletedProcess:
        folder = Path(command[-1].split("=", 1)[1])
        folder.mkdir(parents=True)
        metrics = {s: {"final_acc": 50.0, "forgetting": 1.0} for s in ("til", "cil")}
        (folder / "results.json").write_text(json.dumps({"status": "interrupted", "metrics": metrics}))
        calls.append(command)
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(method_table.subprocess, "run", child)
    row = method_table.measure("finetune", (), tmp_path / "run")
    assert "values" not in row and row["interrupted"] and "interrupted" in row["error"]
    measured = method_table.measure_all(["finetune", "joint"], [], tmp_path / "all")
    assert (
        len(calls) == 2 and list(measured) == ["5 tasks"] and [r["method"] for r in measured["5 tasks"]] == ["finetune"]
    )


@pytest.mark.parametrize("args", [["--readme", "/nonexistent/README.md"], ["--set", "trainer.epochs=abc"]])
def test_make_table_refuses_a_bad_readme_or_override_before_any_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, args: list[str]
) -> None:
    from clbench import method_table

    readme = tmp_path / "README.md"
    before = table_readme(readme, ("simplecil",))
    monkeypatch.setattr(method_table, "measure", lambda *a: pytest.fail("a run started"))
    with pytest.raises(SystemExit) as refused:
        method_table.main(["--readme", str(readme), "--methods", "simplecil", *args])
    said = str(refused.value.code)
    assert said.startswith("clbench-table: ") and ("/nonexistent/README.md" in said or "trainer.epochs" in said)
    assert readme.read_bytes() == before


def test_the_micro_metrics_and_the_test_time_cost_are_columns(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two seeds: A_T 40 and 44 (micro) beside final 50; the cost after the last task, the same for both, shown once:
    1 and 3 passes, (2 x 8e6 + 8e6 + 0) bits = 3 MB."""
    cost = {"forwards_per_test_image": {"til": 1, "cil": 3}, "stored_bits_per_task": [8e6, 8e6], "shared_bits": 8e6}
    for seed, a_t in ((0, 40.0), (1, 44.0)):
        write_run(tmp_path / "sweep" / str(seed), seed=seed, values={"cil.final_acc_micro": a_t},
                  test_time_cost=[{"after_task": 1, **cost, "memory_bits": 0}])  # fmt: skip
    text, rows = report(tmp_path, capsys)
    (row,) = markdown_rows(text)
    assert row["CIL final"] == "50.00 ± 0.00" and row["CIL A_T (micro)"] == f"42.00 ± {statistics.stdev([40, 44]):.2f}"
    assert row["TIL Ā (micro)"] == "63.00 ± 0.71"  # TIL: A_0 = 80 + s, A_1 = (60 + s + 3 (40 + s)) / 4 = 45 + s
    assert (row["TIL fwd/img"], row["CIL fwd/img"], row["stored MB"]) == ("1.00", "3.00", "3.00")
    assert float(rows[0]["cil_final_acc_micro_mean"]) == 42.0 and rows[0]["cil_forwards_std"] == ""


def test_keys_added_to_the_config_later_set_runs_apart_only_where_they_differ_from_the_old_behaviour(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A results.json written before data.protocol and the task-split keys existed, and a new run at their defaults:
    one setting (one row, one W&B group); a Protocol-P run: another row, labelled by its protocol."""
    write_run(tmp_path / "sweep" / "old", seed=0)
    new = {"data.protocol": "clbench", "data.transforms": "clbench", "data.folder_split": "auto",
           "data.init_classes": None, "data.increment": None}  # fmt: skip
    write_run(tmp_path / "sweep" / "new", seed=1, changes=new)
    write_run(tmp_path / "sweep" / "p", seed=0, changes={**new, "data.protocol": "P"})
    text, _ = report(tmp_path, capsys)
    rows = markdown_rows(text)
    assert {r["setting"]: r["runs"] for r in rows} == {"protocol=clbench": "2", "protocol=P": "1"}


def test_runs_on_one_weights_file_share_a_row_whatever_its_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The hub's copy and a local copy of one file (one SHA-256) are one setting; another file is another row."""
    for seed, (path, sha) in enumerate([(None, "a" * 64), ("/copy/vit.npz", "a" * 64), ("/copy/vit.npz", "b" * 64)]):
        changes = {"backbone.weights": path, "backbone.pretrained": path is None}
        recorded = {"weights_file": path or "/hub/model.safetensors", "weights_sha256": sha}
        write_run(tmp_path / "sweep" / str(seed), seed=seed, changes=changes, backbone_config=recorded)
    _, rows = report(tmp_path, capsys)
    assert sorted((r["runs"], r["setting"]) for r in rows) == [
        ("1", "weights_sha256=bbbbbbbbbbbb"),
        ("2", "weights_sha256=aaaaaaaaaaaa"),
    ]


def test_rows_of_different_protocols_are_labelled_and_said_to_be(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """DER++ on the first 2 of 5 tasks beside finetune on all 5, and finetune under another class order: the benchmark
    says how many tasks ran, a protocol column names what sets each row's protocol apart, and a note says the rows
    must not be compared across protocols. One protocol: no column, no note."""
    derpp = {"method._target_": "clbench.methods.derpp.DERPP", "data.num_tasks": 2}
    for job, changes, method in (
        ("0", derpp, "derpp"),
        ("1", {"data.num_tasks": None}, "finetune"),
        ("2", {"data.num_tasks": None, "data.class_order_seed": 7}, "finetune"),
    ):
        write_run(
            tmp_path / "sweep" / job, method=method, changes={"data.tasks": 5, "data.class_order_seed": 1993} | changes
        )
    text, rows = report(tmp_path, capsys)
    expected = [
        ("derpp", "synthetic_tiny_first2", "class_order_seed=1993, num_tasks=2"),
        ("finetune", "synthetic_tiny", "class_order_seed=1993, num_tasks=5"),
        ("finetune", "synthetic_tiny", "class_order_seed=7, num_tasks=5"),
    ]
    assert sorted((r["method"], r["benchmark"], r["protocol"]) for r in markdown_rows(text)) == expected
    assert sorted((r["method"], r["benchmark"], r["protocol"]) for r in rows) == expected
    assert "compare rows of one protocol only" in text
    assert "Protocol" in (tmp_path / "report.tex").read_text()
    (tmp_path / "sweep" / "0" / "results.json").unlink()
    (tmp_path / "sweep" / "2" / "results.json").unlink()
    text, rows = report(tmp_path, capsys)
    assert rows[0]["protocol"] == "" and "protocol" not in text.splitlines()[0]


def test_a_metric_the_checker_cannot_recompute_is_still_held_to_its_range() -> None:
    """A metric beside the ones computed from the matrix (a micro accuracy, say): a number, an accuracy in [0, 100]
    unless it is a forgetting, BWT or FWT."""
    from clbench.results_check import metric_problem

    assert metric_problem("final_acc_micro", -5.0, "m") == "m is -5.0, outside [0, 100]"
    assert metric_problem("forgetting_micro", -5.0, "m") is None
    assert metric_problem("avg_incremental_acc_micro", "x", "m") == "m is 'x', not a number"
