"""`make table` / `python -m clbench.method_table`: the README's method tables, measured, not typed.

Every method (conf/method/*.yaml) runs its default config on the embedded default as a user runs it (`clbench
method=M`, seed 0, W&B off), once on the 5 digit tasks and once with `data.num_tasks=3` (the acceptance command);
each row is read from the run's results.json (TIL and CIL final accuracy and forgetting) and the command's wall time.
The tables stand between the README's markers ``<!-- method-table: 5 tasks -->`` and ``<!-- /method-table -->`` (and
the same for 3 tasks), with the machine and the date below them. Only a run that finished writes its row; every other
row stays as it stood (a failed or interrupted run, a narrower ``--methods``), and without a finished run the README
is not written at all; the command says which rows it wrote. A stop signal (Ctrl-C) ends the table after the run it
interrupted. The README, the methods and the ``--set`` overrides are checked before the first run.

A row is its method's default config on its table's benchmark: ``--set`` may change a setting (a quick check with
``trainer.epochs=1``), and the row then says so (``er (trainer.epochs=1)``), but never the method (``method=finetune``
would put finetune's numbers in another method's row) nor what the table measures (the benchmark, its tasks, their
order, the split: ``data.num_tasks=2`` is neither table). A run whose results.json is not its row's method, benchmark
and config writes no row.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

from clbench.comparable import benchmark_label, compact, differing_keys, is_protocol
from clbench.comparable import setting as flat_setting
from clbench.config import config_dir, full_config
from clbench.errors import ConfigError
from clbench.files import check_writable, write_atomic
from clbench.methods import METHODS

SETTINGS = {"5 tasks": (), "3 tasks": ("data.num_tasks=3",)}
COLUMNS = ("TIL final", "TIL forgetting", "CIL final", "CIL forgetting", "seconds")


def method_names() -> list[str]:
    """Every method config clbench ships, in the README's order."""
    names = {p.stem for p in (config_dir() / "method").glob("*.yaml")}
    return [m for m in METHODS if m in names] + sorted(names - set(METHODS))  # the README's order, then the rest


def measure(
    method: str, overrides: tuple[str, ...], folder: Path, expected: dict[str, Any] | None = None
) -> dict[str, Any]:
    """One `clbench method=...` run in its own process: its metrics and wall time, or why it has none. Only a run whose
    results.json says ``finished`` counts: one stopped by a signal exits 0 with the metrics of the tasks it trained
    (``interrupted`` marks it, so that the table stops there); and only one whose results.json is the ``expected``
    config (the row's, as composed before the first run)."""
    command = [sys.executable, "-m", "clbench", f"method={method}", *overrides, "logger.mode=disabled"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"}
    start = time.perf_counter()
    done = subprocess.run([*command, f"hydra.run.dir={folder}"], capture_output=True, text=True, env=env)  # noqa: PLW1510
    seconds = time.perf_counter() - start
    try:
        run = json.loads((folder / "results.json").read_text())
    except (OSError, ValueError):
        run = {}
    status = run.get("status")
    if done.returncode != 0 or status != "finished":
        lines = [line for line in done.stderr.splitlines() if line.strip() and "HYDRA_FULL_ERROR" not in line]
        said = lines[-1].strip() if lines else f"exit code {done.returncode}, no output"
        error = said if done.returncode != 0 else f"the run ended {status or 'without results.json'}"
        return {"method": method, "error": error, "interrupted": status == "interrupted" or done.returncode < 0}
    wrong = not_the_row(run, method, expected) if expected is not None else None
    if wrong:
        return {"method": method, "error": wrong, "interrupted": False}
    metrics = run["metrics"]
    values = (metrics["til"]["final_acc"], metrics["til"]["forgetting"], metrics["cil"]["final_acc"])
    return {"method": method, "values": (*values, metrics["cil"]["forgetting"], seconds)}


def not_the_row(run: dict[str, Any], method: str, expected: dict[str, Any]) -> str | None:
    """Why a finished run's results.json is not its row's (a smoke run, another method, benchmark or config); None
    when it is."""
    if run.get("smoke"):
        return "a smoke run (smoke=true) is not a result: no row written"
    config = run.get("config") or {}
    keys = differing_keys([flat_setting(config), flat_setting(expected)])
    if "method._target_" in keys:  # by its class: a config's name (classifier) may run another's class (finetune)
        ran = config.get("method", {}).get("_target_")
        return f"the run measured {ran}, not the {method} row's {expected['method']['_target_']}: no row written"
    label = benchmark_label(expected["data"])
    if run.get("benchmark") != label:
        return f"the run measured {run.get('benchmark')}, not the table's {label}: no row written"
    return f"the run's config is not its row's ({', '.join(keys)}): no row written" if keys else None


def markdown(rows: list[dict[str, Any]]) -> str:
    """The measured rows as a Markdown table (one decimal; seconds whole); a row measured with overrides of its
    method's defaults names them beside the method."""
    lines = ["| method | " + " | ".join(COLUMNS) + " |", "|---|" + "---|" * len(COLUMNS)]
    for row in rows:
        *accuracy, seconds = row["values"]
        cells = ["-" if v is None else f"{v:.1f}" for v in accuracy] + [f"{seconds:.0f}"]
        marks = row.get("overrides") or []
        name = f"{row['method']} ({', '.join(marks)})" if marks else row["method"]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


BLOCK = r"(<!-- method-table: {} -->\n)(.*?)(\n<!-- /method-table -->)"


def block(text: str, setting: str) -> re.Match:
    """The setting's table block of ``text`` (table, blank line, stamp lines); an error without its markers."""
    found = re.search(BLOCK.format(re.escape(setting)), text, re.S)
    if found is None:
        raise SystemExit(f"clbench-table: no `<!-- method-table: {setting} -->` ... `<!-- /method-table -->` block")
    return found


def merge(text: str, setting: str, rows: list[dict[str, Any]], stamp: str, every: bool) -> str:
    """``text`` with the setting's table holding the measured ``rows`` (a failed one is not written: the row it would
    replace stays) and every other row as it stood, in the README's order; ``text`` itself without a measured row.
    Measuring every method (``every``, and none failed) replaces the stamp; a narrower measurement adds a line naming
    the methods it measured again."""
    fresh = {row["method"]: markdown([row]).splitlines()[2] for row in rows if "error" not in row}
    if not fresh:
        return text
    found = block(text, setting)
    old_table, _, old_stamp = found.group(2).partition("\n\n")
    kept = {line.split("|")[1].split()[0]: line for line in old_table.splitlines()[2:] if line.startswith("| ")}
    merged = kept | fresh
    order = [m for m in method_names() if m in merged] + sorted(set(merged) - set(method_names()))
    header = "\n".join(markdown([]).splitlines()[:2])
    table = "\n".join([header, *(merged[m] for m in order)])
    if not (every and set(fresh) >= set(method_names())) and old_stamp:
        stamp = old_stamp + "\n" + textwrap.fill(f"{stamp.removesuffix('.')}: {', '.join(fresh)}.", 120)
    return text[: found.start(2)] + table + "\n\n" + stamp + text[found.end(2) :]


def readme_text(path: Path) -> str:
    """The README to rewrite, read before anything is measured: it must be readable, hold both table blocks and sit
    in a folder that can be written."""
    try:
        text = path.read_text()
        check_writable(path.parent, hint="Name another file with --readme PATH.")
    except (OSError, UnicodeDecodeError, ConfigError) as err:
        raise SystemExit(f"clbench-table: cannot use --readme {path}: {err}") from None
    for setting in SETTINGS:
        block(text, setting)
    return text


def row_config(method: str, overrides: list[str]) -> dict[str, Any]:
    """The whole config `clbench method=<method> <overrides>` runs (composed and validated as the CLI does); a
    config error ends the table before any run."""
    from clbench.bench.timing import compose

    try:
        return full_config(compose([f"method={method}", *overrides]))
    except Exception as err:  # Hydra's and clbench's config errors alike (Hydra's detail is in its cause)
        detail = ": ".join(str(e).strip().splitlines()[0] for e in (err, err.__cause__) if e and str(e).strip())
        raise SystemExit(f"clbench-table: method={method} {' '.join(overrides)}: {detail}; nothing measured") from None


def check_overrides(methods: list[str], extra: list[str]) -> dict[str, dict[str, Any]]:
    """Before the first run: every row's config (method, table setting) with the ``--set`` overrides, composed and
    validated, and refused where it would not be the row's: another method, or another benchmark, task count, class
    order or split than the table's. Returns each row's config, keyed ``<setting>/<method>``, with the settings that
    differ from the method's defaults under ``"overrides"`` (the row's mark)."""
    configs = {}
    for method in methods:
        for name, overrides in SETTINGS.items():
            row, chosen = row_config(method, list(overrides)), row_config(method, [*overrides, *extra])
            changed = differing_keys([flat_setting(row), flat_setting(chosen)])
            said = " ".join(extra)
            picks = [o for o in extra if o.lstrip("+~").split("=", 1)[0] == "method"]  # another config, same class too
            if "method._target_" in changed or picks:
                raise SystemExit(
                    f"clbench-table: --set {said} would measure {', '.join(picks) or chosen['method']['_target_']} in "
                    f"the {method} row: a method's row holds its own method's numbers; nothing measured"
                )
            if chosen.get("smoke"):
                raise SystemExit(f"clbench-table: --set {said}: a smoke run is not a result; nothing measured")
            measured = [k for k in changed if is_protocol(k)]
            if measured:
                moved = ", ".join(f"{k}: {compact(flat(row, k))} -> {compact(flat(chosen, k))}" for k in measured)
                raise SystemExit(
                    f"clbench-table: --set {said} changes what the {name} table measures ({moved}); its rows are "
                    f"{benchmark_label(row['data'])} runs; nothing measured"
                )
            marks = [f"{k}={compact(flat(chosen, k))}" for k in changed]
            configs[f"{name}/{method}"] = {"config": chosen, "overrides": marks}
    return configs


def flat(config: dict[str, Any], key: str) -> Any:
    """A flattened config's value at the dotted ``key`` (None where it has none)."""
    return flat_setting(config).get(key)


def measure_all(
    methods: list[str], extra: list[str], tmp: Path, configs: dict[str, dict[str, Any]] | None = None
) -> dict[str, list[dict[str, Any]]]:
    """Every method in every setting, in order, until a run is interrupted (a stop signal: the table stops there);
    ``configs``: each row's config and marks (:func:`check_overrides`), checked against what the run wrote."""
    measured: dict[str, list[dict[str, Any]]] = {}
    for name, overrides in SETTINGS.items():
        rows = measured.setdefault(name, [])
        for method in methods:
            row_of = (configs or {}).get(f"{name}/{method}", {})
            try:
                row = measure(method, (*overrides, *extra), tmp / name.replace(" ", "_") / method, row_of.get("config"))
            except KeyboardInterrupt:
                row = {"method": method, "error": "interrupted", "interrupted": True}
            row["overrides"] = row_of.get("overrides", [])
            print(f"{name} {method}: {row.get('values', row.get('error'))}", file=sys.stderr)
            rows.append(row)
            if row.get("interrupted"):
                return measured
    return measured


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="clbench-table", description=__doc__.split("\n\n")[0])
    parser.add_argument("--readme", type=Path, default=Path("README.md"), help="the file whose tables are rewritten")
    parser.add_argument(
        "--methods", nargs="+", choices=method_names(), default=None, help="only these methods (default: every one)"
    )
    parser.add_argument("--set", nargs="*", default=[], help="overrides added to every run (e.g. for a quick check)")
    args = parser.parse_args(argv)
    methods = args.methods or method_names()
    text = readme_text(args.readme)
    configs = check_overrides(methods, args.set)
    stamp = f"Measured by `make table` on {datetime.date.today()} ({machine()}, Python {platform.python_version()})."
    every = set(methods) >= set(method_names()) and not args.set
    with tempfile.TemporaryDirectory(prefix="clbench-table-") as tmp:
        measured = measure_all(methods, args.set, Path(tmp), configs)
    for setting, rows in measured.items():
        text = merge(text, setting, rows, stamp, every)
    print(*summary(measured, methods), sep="\n", file=sys.stderr)
    finished = sum("error" not in r for rows in measured.values() for r in rows)
    if not finished:
        raise SystemExit(f"clbench-table: no run finished: nothing written, {args.readme} is unchanged")
    write_atomic(args.readme, text)
    print(f"written: {finished} measured rows into {args.readme}, every other row as it stood", file=sys.stderr)
    if finished < len(methods) * len(SETTINGS):
        sys.exit(1)


def summary(measured: dict[str, list[dict[str, Any]]], methods: list[str]) -> list[str]:
    """Per setting: the methods measured, those whose run failed and those not measured (the table was stopped)."""
    lines = []
    for setting in SETTINGS:
        rows = measured.get(setting, [])
        failed = "; ".join(f"{r['method']} ({r['error']})" for r in rows if "error" in r)
        left = ", ".join(m for m in methods if m not in {r["method"] for r in rows})
        line = f"{setting}: measured {', '.join(r['method'] for r in rows if 'error' not in r) or 'none'}"
        line += f"; failed, row kept as it stood: {failed}" if failed else ""
        lines.append(line + (f"; not measured (stopped), row kept as it stood: {left}" if left else ""))
    return lines


def machine() -> str:
    """Where the runs ran: the GPU they use by default, or the CPU's core count."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return f"CPU, {len(os.sched_getaffinity(0))} cores, torch {torch.__version__}"


if __name__ == "__main__":
    main()
