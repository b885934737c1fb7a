"""`clbench-report PATH...`: a paper-style table over every results.json under the given run or multirun folders.

A row is one setting: the runs whose whole configs are equal except for the seed (and keys that cannot change the
numbers, such as logger.* or trainer.log_every; see clbench.comparable). Different configs are never averaged: a
sweep over trainer.lr=1e-3,1e-4 and seed=0,1 gives two rows of two runs each.

Columns: method, backbone and benchmark; setting, the config keys that set the row apart from the other rows of the
same method, backbone and benchmark (e.g. "lr=0.001", "-" when there is no other); runs, the number of finished
runs averaged; then for TIL and CIL the final accuracy and average incremental accuracy as means over the tasks
(macro), the same two over every seen test image (micro: Protocol P's A_T and Ā), forgetting, backward transfer
(BWT) and forward transfer (FWT), in %, as mean ± sample std over the runs (the value alone for one run; "-" where
no run measured it); then the test-time cost after the last task: backbone passes a test image (TIL, CIL) and the
state the method stores (MB: per task, shared and rehearsal memory), the value alone where the runs agree.

Runs that did not finish are listed with their status and failure, not averaged, as are Hydra job folders (those
with a .hydra/ folder) that have no results.json, with their overrides and the last line of their log.

A method clbench reconstructs from what its paper states (results.json ``reconstructed: true``: TFM, KSM) is marked †
in every output, with a legend (.md and .tex), a ``reconstructed`` column (.csv) and "reconstructed" in the figure's
legend.

Writes PREFIX.md, .csv, .tex (booktabs) and a figure (.png and .pdf) of the mean accuracy over the seen tasks after
each task, one line per row with a band of ± one std over its runs. PREFIX is --out, by default ``report`` in the
folder the given paths share (a sweep's folder), never the working folder.

With --table NAME (e.g. l2p_table1, meat_table1): the runs laid out as that paper's table instead, rows in the
paper's order, clbench's mean ± std beside the published number and the difference (clbench.paper_table); writes
PREFIX.md, .csv and .tex.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import statistics
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib
import yaml

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from clbench import paper_table
from clbench.comparable import (
    LATER_KEYS,
    WEIGHTS_HASH,
    benchmark_label,
    compact,
    config_of,
    differing_keys,
    protocol,
    run_setting,
    setting_key,
    short_names,
)
from clbench.errors import ConfigError
from clbench.files import check_writable, write_atomic
from clbench.metrics import stored_bits
from clbench.paper_table import RECONSTRUCTED, booktabs, tex_escape
from clbench.results_check import is_number, problem

Run = dict[str, Any]
SCENARIOS = ("til", "cil")
METRICS = (
    "final_acc",
    "avg_incremental_acc",
    "final_acc_micro",
    "avg_incremental_acc_micro",
    "forgetting",
    "bwt",
    "fwt",
)
LABELS = {
    "final_acc": "final",
    "avg_incremental_acc": "avg inc",
    "final_acc_micro": "A_T (micro)",
    "avg_incremental_acc_micro": "Ā (micro)",
    "forgetting": "forgetting",
    "bwt": "BWT",
    "fwt": "FWT",
}
COST = {"til_forwards": "TIL fwd/img", "cil_forwards": "CIL fwd/img", "stored_mb": "stored MB"}  # after the last task
COLUMNS = [f"{s}_{m}" for s in SCENARIOS for m in METRICS] + list(COST)
HEADERS = [f"{s.upper()} {LABELS[m]}" for s in SCENARIOS for m in METRICS] + list(COST.values())
REQUIRED = ("method", "backbone", "benchmark", "metrics", "acc_matrix")
LOG_TAIL_BYTES = 65536


@dataclass
class Row:
    """The finished runs of one setting, with the label that sets it apart from its neighbours."""

    method: str
    backbone: str
    benchmark: str
    setting: str
    runs: list[Run]
    protocol: str = ""  # the protocol keys that set it apart where the rows come from several protocols

    @property
    def reconstructed(self) -> bool:
        """A reconstruction of its paper's method (results.json ``reconstructed: true``: TFM, KSM), marked †."""
        return any(r.get("reconstructed") is True for r in self.runs)

    @property
    def name(self) -> str:
        """The method, with † when it is a reconstruction."""
        return f"{self.method} †" if self.reconstructed else self.method

    def stat(self, column: str) -> tuple[float | None, float | None]:
        """Mean and sample std of a column over the runs that measured it (std None for one run, and for a cost the
        runs agree on)."""
        values = [value(r, column) for r in self.runs]
        if column in COST and len({v for v in values if v is not None}) == 1:
            return next(v for v in values if v is not None), None
        return mean_std(values)


def value(run: Run, column: str) -> float | None:
    """A column's value in a run: ``<scenario>_<metric>`` from its metrics, or a test-time cost after its last task
    (results.json ``test_time_cost``; None in a run that did not record it)."""
    if column not in COST:
        scenario, metric = column.split("_", 1)
        return run["metrics"].get(scenario, {}).get(metric)
    costs = run.get("test_time_cost") or []
    if not costs:
        return None
    if column == "stored_mb":
        return stored_bits(costs[-1]) / 8e6
    return costs[-1]["forwards_per_test_image"][column.split("_", maxsplit=1)[0]]


@dataclass
class Skipped:
    """A run or job that is listed, not averaged: its folder, why, and its Hydra overrides when recorded."""

    folder: Path
    reason: str
    overrides: list[str]

    def __str__(self) -> str:
        named = f" (overrides: {' '.join(self.overrides)})" if self.overrides else ""
        return f"{self.folder}{named}: {self.reason}"


def find_results(paths: list[Path]) -> list[Path]:
    """Every results.json given or under the given folders."""
    found: set[Path] = set()
    for path in paths:
        if path.is_file() and path.name == "results.json":
            found.add(path.resolve())
        elif path.is_dir():
            found |= {p.resolve() for p in path.rglob("results.json")}
    return sorted(found)


def find_jobs(paths: list[Path]) -> list[Path]:
    """Every Hydra job folder (one holding a .hydra/ folder) given or under the given folders."""
    return sorted({p.parent.resolve() for path in paths if path.is_dir() for p in path.rglob(".hydra") if p.is_dir()})


def overrides(folder: Path) -> list[str]:
    """The job's command-line overrides from .hydra/overrides.yaml (none when absent or unreadable)."""
    try:
        loaded = yaml.safe_load((folder / ".hydra" / "overrides.yaml").read_text())
    except (OSError, yaml.YAMLError):
        return []
    return [str(o) for o in loaded] if isinstance(loaded, list) else []


def last_log_line(folder: Path) -> str:
    """The last non-empty line of the job's clbench.log (or any other *.log there); "no log" when there is none."""
    logs = [folder / "clbench.log"] if (folder / "clbench.log").is_file() else sorted(folder.glob("*.log"))
    if not logs:
        return "no log"
    with logs[0].open("rb") as f:
        f.seek(max(0, f.seek(0, 2) - LOG_TAIL_BYTES))
        lines = [line.strip() for line in f.read().decode(errors="replace").splitlines()]
    return next((line for line in reversed(lines) if line), "empty log")


def skipped(folder: Path, reason: str) -> Skipped:
    """A listed folder with its reason and the overrides Hydra recorded there."""
    return Skipped(folder, reason, overrides(folder))


def read_run(path: Path) -> Run | Skipped:
    """A finished run whose numbers can be reported, or why it is listed instead: its status and failure's first line,
    a file that is not JSON, a smoke run, or numbers that are not numbers, out of range or contradicted by its own
    matrices (:mod:`clbench.results_check`)."""
    try:
        run = json.loads(path.read_bytes().decode())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        return skipped(path.parent, f"unreadable results.json: {type(err).__name__}: {err}")
    if not isinstance(run, dict):
        return skipped(path.parent, "unreadable results.json: not an object")
    status = str(run.get("status", "unknown"))
    if status != "finished":
        failure = str(run.get("failure") or "").strip().splitlines()
        return skipped(path.parent, status + (f": {failure[0]}" if failure else ""))
    if run.get("smoke"):
        return skipped(path.parent, "a smoke run (smoke=true: a few images and steps a task), not a result")
    missing = [k for k in REQUIRED if k not in run]
    if missing:
        return skipped(path.parent, f"incomplete results.json: no {', '.join(missing)}")
    wrong = problem(run) or cost_problem(run)
    return skipped(path.parent, f"results.json not reported: {wrong}") if wrong else run


def cost_problem(run: Run) -> str | None:
    """What in a run's ``test_time_cost`` is not what the report reads (None where it is, or where there is none)."""
    costs = run.get("test_time_cost")
    if costs is not None and not (isinstance(costs, list) and all(map(is_cost, costs))):
        return "test_time_cost is not a list of costs (forwards per test image, stored bits)"
    return None


def is_cost(cost: Any) -> bool:
    """Whether an entry of ``test_time_cost`` holds what the report reads, as numbers."""
    try:
        forwards, per_task = cost["forwards_per_test_image"], cost["stored_bits_per_task"]
        numbers = [forwards["til"], forwards["cil"], cost["shared_bits"], cost["memory_bits"], *per_task]
    except (KeyError, TypeError):
        return False
    return all(map(is_number, numbers))


def load(paths: list[Path]) -> tuple[list[Run], list[Skipped]]:
    """The finished runs under ``paths`` (one per setting and seed), and the runs and jobs that are listed instead."""
    runs, folders, others = [], [], []
    for path in find_results(paths):
        result = read_run(path)
        if isinstance(result, Skipped):
            others.append(result)
        else:
            result["_folder"] = str(path.parent)  # for --table: the job folder tells the run's preset
            runs.append(result)
            folders.append(path.parent)
    runs, duplicates = without_duplicates(runs, folders)
    others += duplicates
    jobs = [job for job in find_jobs(paths) if not (job / "results.json").exists()]
    others += [skipped(job, f"no results.json; last log line: {last_log_line(job)}") for job in jobs]
    return runs, sorted(others, key=lambda o: str(o.folder))


def labels(settings: list[dict[str, Any]]) -> list[str]:
    """Each flattened setting's keys that differ among ``settings``, ``lr=0.001, epochs=5`` ("" for one setting; a
    weights hash shortened to 12 characters)."""
    if len(settings) < 2:
        return [""] * len(settings)
    keys = differing_keys(settings)
    names = short_names(keys)

    def shown(key: str, values: dict[str, Any]) -> str:
        if key not in values:  # a key added later, at its old value: left out of the setting
            return compact(LATER_KEYS[key]) if key in LATER_KEYS else "unset"
        return compact(values[key])[:12] if key == WEIGHTS_HASH else compact(values[key])

    return [", ".join(f"{names[k]}={shown(k, s)}" for k in keys) for s in settings]


def without_duplicates(runs: list[Run], folders: list[Path]) -> tuple[list[Run], list[Skipped]]:
    """One run per (setting, seed): a second run of the same setting and seed (the same run found twice, under two
    folders given) would count twice and shrink the std; it is listed as a duplicate instead."""
    first: dict[tuple[str, Any], Path] = {}
    kept, duplicates = [], []
    for run, folder in zip(runs, folders, strict=True):
        key = (setting_key(run), run.get("seed"))
        if key in first:
            duplicates.append(skipped(folder, f"duplicate of {first[key]} (the same setting and seed {key[1]})"))
            continue
        first[key] = folder
        kept.append(run)
    return kept, duplicates


def benchmark_of(run: Run) -> str:
    """The benchmark a run measured: its data config's name, with the tasks kept where it ran fewer
    (:func:`clbench.comparable.benchmark_label`; an older results.json's ``benchmark`` as it stands)."""
    data = config_of(run).get("data")
    return benchmark_label(data) if isinstance(data, dict) and "tasks" in data else str(run["benchmark"])


def table_rows(runs: list[Run]) -> list[Row]:
    """One row per setting, labelled among the rows of its (method, backbone, benchmark); where the rows come from
    several protocols (task count, class order, split: clbench.comparable.PROTOCOL), each is labelled by the protocol
    keys that set it apart and the rows of one protocol stand together."""
    groups: dict[str, list[Run]] = defaultdict(list)
    for run in runs:
        groups[setting_key(run)].append(run)
    families: dict[tuple[str, str, str], list[list[Run]]] = defaultdict(list)
    for group in groups.values():
        families[(group[0]["method"], group[0]["backbone"], benchmark_of(group[0]))].append(group)
    rows = [
        Row(*family, label, group)
        for family, members in families.items()
        for group, label in zip(members, labels([run_setting(g[0]) for g in members]), strict=True)
    ]
    protocols = [protocol(config_of(r.runs[0])) for r in rows]
    if len({json.dumps(p, sort_keys=True, default=str) for p in protocols}) > 1:
        for row, label in zip(rows, labels(protocols), strict=True):
            row.protocol = label
    return sorted(rows, key=lambda r: (r.protocol, r.method, r.backbone, r.benchmark, r.setting))


def several_protocols(rows: list[Row]) -> bool:
    return any(r.protocol for r in rows)


PROTOCOLS = (
    "These rows come from different protocols (task count, class order, train/test split or CIL's classes: the "
    "protocol column): compare rows of one protocol only."
)


def mean_std(values: list[float | None]) -> tuple[float | None, float | None]:
    """Mean and sample std of the values present; std None for one value, both None for none."""
    present = [v for v in values if v is not None]
    if not present:
        return None, None
    return statistics.fmean(present), statistics.stdev(present) if len(present) > 1 else None


def cell(pair: tuple[float | None, float | None], pm: str) -> str:
    """``mean ± std``, the mean alone without a std, "-" without a value."""
    mean, std = pair
    if mean is None:
        return "-"
    return f"{mean:.2f}" if std is None else f"{mean:.2f} {pm} {std:.2f}"


def label_cells(r: Row, protocols: bool) -> list[str]:
    """A row's label columns: method, backbone, benchmark, (protocol,) setting."""
    return [r.name, r.backbone, r.benchmark, *([r.protocol] if protocols else []), r.setting or "-"]


def legends(rows: list[Row]) -> list[str]:
    """The notes under a table: the † legend, and that its rows come from several protocols."""
    return [
        text
        for text, on in ((RECONSTRUCTED, any(r.reconstructed for r in rows)), (PROTOCOLS, several_protocols(rows)))
        if on
    ]


def markdown(rows: list[Row], others: list[Skipped]) -> str:
    """The table as Markdown (a protocol column where its rows come from several), its notes, then the runs and jobs
    that were not averaged."""
    protocols = several_protocols(rows)
    head = ["method", "backbone", "benchmark", *(["protocol"] if protocols else []), "setting", "runs", *HEADERS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        label = [*label_cells(r, protocols), str(len(r.runs))]
        cells = [text.replace("|", r"\|") for text in label] + [cell(r.stat(c), "±") for c in COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [line for text in legends(rows) for line in ("", text)]
    if others:
        lines += ["", "Not averaged (did not finish, not reportable or duplicates):", *[f"- {o}" for o in others]]
    return "\n".join(lines) + "\n"


def csv_text(rows: list[Row]) -> str:
    """The table as CSV: the label columns (protocol: empty where every row shares one), then
    ``<scenario>_<metric>_mean`` and ``_std`` (empty for one run)."""
    buf = io.StringIO()
    writer = csv.writer(buf)
    labels_ = ["method", "backbone", "benchmark", "protocol", "setting", "runs", "reconstructed"]
    writer.writerow([*labels_, *[f"{c}_{k}" for c in COLUMNS for k in ("mean", "std")]])
    for r in rows:
        values = ["" if v is None else f"{v:.4f}" for c in COLUMNS for v in r.stat(c)]
        writer.writerow(
            [r.method, r.backbone, r.benchmark, r.protocol, r.setting, len(r.runs), r.reconstructed, *values]
        )
    return buf.getvalue()


def latex(rows: list[Row]) -> str:
    """The table as a booktabs tabular (a protocol column where its rows come from several), its notes below."""
    protocols = several_protocols(rows)
    head = " & ".join(
        ["Method", "Backbone", "Benchmark", *(["Protocol"] if protocols else []), "Setting", "$n$", *HEADERS]
    )
    body = [
        " & ".join(
            [
                *map(tex_escape, label_cells(r, protocols)),
                str(len(r.runs)),
                *[cell(r.stat(c), r"$\pm$") for c in COLUMNS],
            ]
        )
        + r" \\"
        for r in rows
    ]
    spec = "l" * (4 + protocols) + "r" + "r" * len(COLUMNS)
    return "\n".join(booktabs(spec, head + r" \\", body, legends(rows))) + "\n"


def seen_task_curve(run: Run, scenario: str) -> list[float]:
    """Mean accuracy over the seen tasks after each task: the mean of R[i][:i+1]."""
    return [statistics.fmean(row[: i + 1]) for i, row in enumerate(run["acc_matrix"][scenario])]


def curve_label(row: Row, rows: list[Row]) -> str:
    """The method, with backbone and benchmark when the rows do not all share them, the protocol and the setting."""
    parts = [row.backbone] if len({r.backbone for r in rows}) > 1 else []
    parts += [row.benchmark] if len({r.benchmark for r in rows}) > 1 else []
    parts += [row.protocol] if row.protocol else []
    parts += [row.setting] if row.setting else []
    parts += ["reconstructed"] if row.reconstructed else []
    return f"{row.method} ({'; '.join(parts)})" if parts else row.method


def row_curve(row: Row, scenario: str) -> tuple[list[float], list[float] | None]:
    """Per task learned, the mean of the seen-task curve over the row's runs, and its std (None for one run)."""
    per_task = [list(values) for values in zip(*(seen_task_curve(r, scenario) for r in row.runs), strict=False)]
    std = [statistics.stdev(v) for v in per_task] if len(row.runs) > 1 else None
    return [statistics.fmean(v) for v in per_task], std


def curves_figure(rows: list[Row]) -> Figure:
    """TIL and CIL panels (one y-axis): per row, the mean over its runs of the seen-task curve, ± one std band."""
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, scenario in zip(axes, SCENARIOS, strict=True):
        for row in rows:
            mean, std = row_curve(row, scenario)
            x = range(1, len(mean) + 1)
            (line,) = ax.plot(x, mean, marker="o", label=curve_label(row, rows))
            if std is not None:
                band = list(zip(mean, std, strict=True))
                ax.fill_between(
                    x, [m - s for m, s in band], [m + s for m, s in band], color=line.get_color(), alpha=0.2
                )
        ax.set_title(f"{scenario.upper()}: mean accuracy over seen tasks")
        ax.set_xlabel("tasks learned")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("accuracy (%)")
    axes[0].set_ylim(0, 100)
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    return fig


def figure_bytes(fig: Figure, fmt: str) -> bytes:
    """The figure saved in ``fmt`` (png, pdf)."""
    buf = io.BytesIO()
    fig.savefig(buf, format=fmt, dpi=110)
    return buf.getvalue()


def write_report(rows: list[Row], others: list[Skipped], out: Path) -> list[Path]:
    """Print the Markdown table and write every output under the prefix ``out``; the files written."""
    text = markdown(rows, others)
    print(text, end="")
    outputs: dict[str, str | bytes] = {".md": text, ".csv": csv_text(rows), ".tex": latex(rows)}
    if rows:
        fig = curves_figure(rows)
        outputs |= {".png": figure_bytes(fig, "png"), ".pdf": figure_bytes(fig, "pdf")}
        plt.close(fig)
    for suffix, data in outputs.items():
        write_atomic(out.with_suffix(suffix), data)
    return [out.with_suffix(suffix) for suffix in outputs]


def default_out(paths: list[Path], table: str | None) -> Path:
    """Where a report goes without ``--out``: in the folder the runs share (a sweep's folder), named ``report`` (or
    after the paper table it lays out), so that it never lands in the working folder by surprise."""
    folders = [(p if p.is_dir() else p.parent).resolve() for p in paths]
    return Path(os.path.commonpath(folders)) / (table or "report")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="clbench-report", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("paths", nargs="+", type=Path, help="run folders, multirun folders or results.json files")
    parser.add_argument(
        "--out",
        type=Path,
        help="output prefix (default: beside the runs it reads: <their common folder>/report, or /<table> with "
        "--table)",
    )
    parser.add_argument(
        "--table",
        metavar="NAME",
        help="lay the runs out as a paper's table beside its published numbers (clbench.paper_table), e.g. "
        f"l2p_table1; known: {', '.join(paper_table.known_tables())}",
    )
    args = parser.parse_args(argv)
    if args.table is not None and args.table not in paper_table.known_tables():
        known = ", ".join(paper_table.known_tables())
        print(f"clbench-report: unknown table {args.table!r}. Known tables: {known}.", file=sys.stderr)
        sys.exit(2)
    args.out = args.out or default_out(args.paths, args.table)
    try:  # before reading anything: a report that cannot be written is refused at once
        check_writable(args.out.parent, hint="Choose another prefix with --out PATH.")
    except ConfigError as err:
        print(f"clbench-report: {err}", file=sys.stderr)
        sys.exit(2)
    runs, others = load(args.paths)
    if not runs and not others:
        print(f"clbench-report: no results.json or job folder under {', '.join(map(str, args.paths))}", file=sys.stderr)
        sys.exit(2)
    if args.table is not None:
        outputs = paper_table.report(args.table, runs, others)
        print(outputs[".md"], end="")
        for suffix, text in outputs.items():
            write_atomic(args.out.with_suffix(suffix), text)
        written = [args.out.with_suffix(suffix) for suffix in outputs]
    else:
        written = write_report(table_rows(runs), others, args.out)
    print(f"\nwritten: {', '.join(map(str, written))}", file=sys.stderr)


if __name__ == "__main__":
    main()
