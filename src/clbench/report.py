"""`clbench-report PATH...`: a paper-style table over every results.json under the given run or multirun folders.

Rows are (method, backbone, benchmark); columns the TIL and CIL final accuracy, average incremental accuracy and
forgetting, as mean ± std over the runs (seeds) with their number. Runs that did not finish are listed, not
averaged. Written as Markdown, CSV and LaTeX next to a PNG of the mean accuracy over seen tasks after each task.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.ticker import MaxNLocator

from clbench.files import write_atomic

METRICS = ("final_acc", "avg_incremental_acc", "forgetting")
LABELS = {"final_acc": "final", "avg_incremental_acc": "avg inc", "forgetting": "forgetting"}
Key = tuple[str, str, str]


def find_results(paths: list[Path]) -> list[Path]:
    found: set[Path] = set()
    for path in paths:
        if path.is_file() and path.name == "results.json":
            found.add(path.resolve())
        elif path.is_dir():
            found |= {p.resolve() for p in path.rglob("results.json")}
    return sorted(found)


def load_runs(files: list[Path]) -> tuple[dict[Key, list[dict[str, Any]]], list[tuple[Path, str]]]:
    """Finished runs grouped by (method, backbone, benchmark), and the others with their status."""
    groups: dict[Key, list[dict[str, Any]]] = defaultdict(list)
    unfinished = []
    for f in files:
        try:
            run = json.loads(f.read_text())
        except (OSError, json.JSONDecodeError) as err:
            unfinished.append((f, f"unreadable: {err}"))
            continue
        if run.get("status") != "finished":
            unfinished.append((f, str(run.get("status", "unknown"))))
            continue
        groups[(run["method"], run["backbone"], run["benchmark"])].append(run)
    return dict(sorted(groups.items())), unfinished


def mean_std(values: list[float | None]) -> tuple[float | None, float | None]:
    present = [v for v in values if v is not None]
    if not present:
        return None, None
    return statistics.fmean(present), statistics.stdev(present) if len(present) > 1 else 0.0


def table_rows(groups: dict[Key, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per group: mean and std of each scenario's metrics over its runs."""
    rows = []
    for (method, backbone, benchmark), runs in groups.items():
        row: dict[str, Any] = {"method": method, "backbone": backbone, "benchmark": benchmark, "runs": len(runs)}
        for scenario in ("til", "cil"):
            for metric in METRICS:
                row[f"{scenario}_{metric}"] = mean_std([r["metrics"][scenario][metric] for r in runs])
        rows.append(row)
    return rows


def _cell(pair: tuple[float | None, float | None], pm: str) -> str:
    mean, std = pair
    return "-" if mean is None else f"{mean:.2f} {pm} {std:.2f}"


COLUMNS = [f"{s}_{m}" for s in ("til", "cil") for m in METRICS]
HEADERS = [f"{s.upper()} {LABELS[m]}" for s in ("til", "cil") for m in METRICS]


def markdown(rows: list[dict[str, Any]], unfinished: list[tuple[Path, str]]) -> str:
    lines = [
        "| method | backbone | benchmark | runs | " + " | ".join(HEADERS) + " |",
        "|---|---|---|---|" + "---|" * len(HEADERS),
    ]
    for r in rows:
        cells = [_cell(r[c], "±") for c in COLUMNS]
        lines.append(
            f"| {r['method']} | {r['backbone']} | {r['benchmark']} | {r['runs']} | " + " | ".join(cells) + " |"
        )
    if unfinished:
        lines += ["", "Not averaged (did not finish):", *[f"- {path}: {status}" for path, status in unfinished]]
    return "\n".join(lines) + "\n"


def csv_text(rows: list[dict[str, Any]]) -> str:
    buf = io.StringIO()
    writer = csv.writer(buf)
    writer.writerow(
        ["method", "backbone", "benchmark", "runs", *[f"{c}_{k}" for c in COLUMNS for k in ("mean", "std")]]
    )
    for r in rows:
        values = [("" if v is None else f"{v:.4f}") for c in COLUMNS for v in r[c]]
        writer.writerow([r["method"], r["backbone"], r["benchmark"], r["runs"], *values])
    return buf.getvalue()


def latex(rows: list[dict[str, Any]]) -> str:
    def esc(text: str) -> str:
        return text.replace("_", r"\_")

    head = " & ".join(["Method", "Backbone", "Benchmark", "$n$", *HEADERS]) + r" \\"
    body = [
        " & ".join([esc(r["method"]), esc(r["backbone"]), esc(r["benchmark"]), str(r["runs"])])
        + " & "
        + " & ".join(_cell(r[c], r"$\pm$") for c in COLUMNS)
        + r" \\"
        for r in rows
    ]
    spec = "lllr" + "r" * len(COLUMNS)
    return (
        "\n".join(
            [rf"\begin{{tabular}}{{{spec}}}", r"\toprule", head, r"\midrule", *body, r"\bottomrule", r"\end{tabular}"]
        )
        + "\n"
    )


def curves_png(groups: dict[Key, list[dict[str, Any]]]) -> bytes:
    """Mean accuracy over the seen tasks after each task (mean over runs), one line per group, TIL and CIL."""
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, scenario in zip(axes, ("til", "cil"), strict=True):
        for (method, backbone, benchmark), runs in groups.items():
            per_run = [
                [statistics.fmean(row[: i + 1]) for i, row in enumerate(r["acc_matrix"][scenario])] for r in runs
            ]
            curve = [statistics.fmean(vals) for vals in zip(*per_run, strict=False)]
            ax.plot(range(1, len(curve) + 1), curve, marker="o", label=f"{method} ({backbone}, {benchmark})")
        ax.set_title(f"{scenario.upper()}: mean accuracy over seen tasks")
        ax.set_xlabel("tasks learned")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel("accuracy (%)")
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="clbench-report", description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="+", type=Path, help="run folders, multirun folders or results.json files")
    parser.add_argument("--out", type=Path, default=Path("report"), help="output prefix (default: report)")
    args = parser.parse_args(argv)
    files = find_results(args.paths)
    if not files:
        print(f"clbench-report: no results.json under {', '.join(map(str, args.paths))}", file=sys.stderr)
        sys.exit(2)
    groups, unfinished = load_runs(files)
    rows = table_rows(groups)
    text = markdown(rows, unfinished)
    print(text, end="")
    write_atomic(args.out.with_suffix(".md"), text)
    write_atomic(args.out.with_suffix(".csv"), csv_text(rows))
    write_atomic(args.out.with_suffix(".tex"), latex(rows))
    if groups:
        write_atomic(args.out.with_suffix(".png"), curves_png(groups))
    print(f"\nwritten: {args.out}.md, .csv, .tex" + (", .png" if groups else ""), file=sys.stderr)


if __name__ == "__main__":
    main()
