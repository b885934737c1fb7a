"""`make table` / `python -m clbench.method_table`: the README's method tables, measured, not typed.

Every method (conf/method/*.yaml) runs its default config on the embedded default as a user runs it (`clbench
method=M`, seed 0, W&B off), once on the 5 digit tasks and once with `data.num_tasks=3` (the acceptance command);
each row is read from the run's results.json (TIL and CIL final accuracy and forgetting) and the command's wall time.
The tables replace what stands between the README's markers ``<!-- method-table: 5 tasks -->`` and
``<!-- /method-table -->`` (and the same for 3 tasks), with the machine and the date below them.
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

from clbench.config import config_dir
from clbench.files import write_atomic
from clbench.methods import METHODS

SETTINGS = {"5 tasks": (), "3 tasks": ("data.num_tasks=3",)}
COLUMNS = ("TIL final", "TIL forgetting", "CIL final", "CIL forgetting", "seconds")


def method_names() -> list[str]:
    """Every method config clbench ships, in the README's order."""
    names = {p.stem for p in (config_dir() / "method").glob("*.yaml")}
    return [m for m in METHODS if m in names] + sorted(names - set(METHODS))  # the README's order, then the rest


def measure(method: str, overrides: tuple[str, ...], folder: Path) -> dict[str, Any]:
    """One `clbench method=...` run in its own process: its metrics and wall time (or why it failed)."""
    command = [sys.executable, "-m", "clbench", f"method={method}", *overrides, "logger.mode=disabled"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"}
    start = time.perf_counter()
    done = subprocess.run([*command, f"hydra.run.dir={folder}"], capture_output=True, text=True, env=env)  # noqa: PLW1510
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        return {"method": method, "error": (done.stderr.strip().splitlines() or ["no output"])[-1]}
    metrics = json.loads((folder / "results.json").read_text())["metrics"]
    values = (metrics["til"]["final_acc"], metrics["til"]["forgetting"], metrics["cil"]["final_acc"])
    return {"method": method, "values": (*values, metrics["cil"]["forgetting"], seconds)}


def markdown(rows: list[dict[str, Any]]) -> str:
    """The rows as a Markdown table (one decimal; seconds whole)."""
    lines = ["| method | " + " | ".join(COLUMNS) + " |", "|---|" + "---|" * len(COLUMNS)]
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['method']} | failed: {row['error']} |" + " |" * (len(COLUMNS) - 1))
            continue
        *accuracy, seconds = row["values"]
        cells = ["-" if v is None else f"{v:.1f}" for v in accuracy] + [f"{seconds:.0f}"]
        lines.append(f"| {row['method']} | " + " | ".join(cells) + " |")
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
    replace stays) and every other row as it stood, in the README's order. Measuring every method replaces the
    stamp; a narrower measurement adds a line naming the methods it measured again."""
    found = block(text, setting)
    old_table, _, old_stamp = found.group(2).partition("\n\n")
    kept = {line.split("|")[1].strip(): line for line in old_table.splitlines()[2:] if line.startswith("| ")}
    fresh = {row["method"]: markdown([row]).splitlines()[2] for row in rows if "error" not in row}
    merged = kept | fresh
    order = [m for m in method_names() if m in merged] + sorted(set(merged) - set(method_names()))
    header = "\n".join(markdown([]).splitlines()[:2])
    table = "\n".join([header, *(merged[m] for m in order)])
    if not every and old_stamp:
        stamp = old_stamp + "\n" + textwrap.fill(f"{stamp.removesuffix('.')}: {', '.join(fresh)}.", 120)
    return text[: found.start(2)] + table + "\n\n" + stamp + text[found.end(2) :]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="clbench-table", description=__doc__.split("\n\n")[0])
    parser.add_argument("--readme", type=Path, default=Path("README.md"), help="the file whose tables are rewritten")
    parser.add_argument("--methods", nargs="+", default=None, help="only these methods (default: every one shipped)")
    parser.add_argument("--set", nargs="*", default=[], help="overrides added to every run (e.g. for a quick check)")
    args = parser.parse_args(argv)
    methods = args.methods or method_names()
    text = args.readme.read_text()
    stamp = f"Measured by `make table` on {datetime.date.today()} ({machine()}, Python {platform.python_version()})."
    every = set(methods) >= set(method_names()) and not args.set
    with tempfile.TemporaryDirectory(prefix="clbench-table-") as tmp:
        for setting, overrides in SETTINGS.items():
            block(text, setting)  # both blocks exist before anything is measured
            rows = []
            for method in methods:
                row = measure(method, (*overrides, *args.set), Path(tmp) / setting.replace(" ", "_") / method)
                print(f"{setting} {method}: {row.get('values', row.get('error'))}", file=sys.stderr)
                rows.append(row)
            text = merge(text, setting, rows, stamp, every)
    write_atomic(args.readme, text)
    print(f"written: the method tables of {args.readme}", file=sys.stderr)


def machine() -> str:
    """Where the runs ran: the GPU they use by default, or the CPU's core count."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return f"CPU, {len(os.sched_getaffinity(0))} cores, torch {torch.__version__}"


if __name__ == "__main__":
    main()
