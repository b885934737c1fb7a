"""The end of a sweep (``clbench -m ...``): one summary of its jobs, done, failed, refused and stopped, with the jobs
that ended for the same reason grouped under it once, and an exit code that is not 0 when any job did not finish.

Each job records its start, then its outcome, in the sweep's folder (``<sweep dir>/.clbench_jobs/<job>.json``),
whichever process or node ran it (the basic launcher, joblib, SLURM); :class:`SweepSummary`, a Hydra callback, reads
them when the sweep ends, prints the summary and removes them. In one process, a job refused for the reason a job
before it was refused for says so in one line instead of repeating the paragraph.
"""

from __future__ import annotations

import json
import shutil
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from clbench.files import write_atomic
from clbench.hints import HeldStderr

OUTCOMES = ".clbench_jobs"
DONE, FAILED, REFUSED, STOPPED = "done", "failed", "refused", "stopped"
STARTED, KILLED = "started", "killed"  # recorded when a job starts, replaced when it ends: what remains was killed
_SAID: dict[str, int] = {}  # reason -> the job of this process that first said it


def record(sweep_dir: Path, number: int, outcome: str, reason: str | None = None) -> None:
    """Record job ``number``'s outcome: ``started``, then ``done``, ``failed``, ``refused`` (before any work) or
    ``stopped`` (by a signal, with a checkpoint)."""
    entry = {"job": number, "outcome": outcome, "reason": reason}
    write_atomic(sweep_dir / OUTCOMES / f"{number}.json", json.dumps(entry))


def said_before(reason: str, number: int) -> int | None:
    """The job of this process that already printed ``reason`` (None: ``number`` is the first, and now has)."""
    first = _SAID.setdefault(reason, number)
    return None if first == number else first


def outcomes(sweep_dir: Path) -> list[dict[str, Any]]:
    """The jobs' records, by job number (a job still ``started`` was killed before it could say how it ended)."""
    found = []
    for path in (sweep_dir / OUTCOMES).glob("*.json"):
        try:
            entry = json.loads(path.read_text())
            found.append({"job": int(entry["job"]), "outcome": str(entry["outcome"]), "reason": entry.get("reason")})
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return sorted(found, key=lambda e: e["job"])


def summary(entries: list[dict[str, Any]]) -> tuple[list[str], int]:
    """The summary's lines (counts, then each reason once with the jobs it ended) and the sweep's exit code: 1 where a
    job failed, stopped or was killed, else 2 where one was refused (a user error, as a single run's), else 0."""
    counts: dict[str, int] = defaultdict(int)
    reasons: dict[tuple[str, str], list[int]] = defaultdict(list)
    for entry in entries:
        outcome = KILLED if entry["outcome"] == STARTED else entry["outcome"]
        counts[outcome] += 1
        if outcome != DONE:
            why = entry.get("reason") or "started and never ended (out of memory, a time limit, SIGKILL)"
            reasons[(outcome, why.strip())].append(int(entry["job"]))
    parts = [f"{counts[k]} {k}" for k in (DONE, FAILED, REFUSED, STOPPED, KILLED) if counts[k] or k == DONE]
    lines = [f"clbench: sweep of {len(entries)} jobs: {', '.join(parts)}."]
    for (outcome, why), jobs in reasons.items():
        label = "job" if len(jobs) == 1 else f"{len(jobs)} jobs"
        lines.append(f"  {outcome}, {label} ({numbers(jobs)}): " + why.replace("\n", "\n    "))
    code = 1 if counts[FAILED] or counts[STOPPED] or counts[KILLED] else 2 if counts[REFUSED] else 0
    return lines, code


def numbers(jobs: list[int]) -> str:
    """Job numbers as a user reads them: runs of three or more as ranges (``0-47``, ``1, 2, 5-9``)."""
    runs: list[list[int]] = []
    for job in sorted(jobs):
        if runs and job == runs[-1][-1] + 1:
            runs[-1].append(job)
        else:
            runs.append([job])
    return ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 2 else ", ".join(map(str, r)) for r in runs)


class SweepSummary(Callback):
    """Registered in conf/config.yaml under hydra.callbacks: at the end of a sweep, its summary and exit code."""

    def on_multirun_start(self, config: DictConfig, **kwargs: object) -> None:
        HeldStderr.release()  # the sweep's config composed: what Hydra said meanwhile is said now
        shutil.rmtree(Path(str(config.hydra.sweep.dir)) / OUTCOMES, ignore_errors=True)  # a killed sweep's records

    def on_multirun_end(self, config: DictConfig, **kwargs: object) -> None:
        sweep_dir = Path(str(config.hydra.sweep.dir))
        entries = outcomes(sweep_dir)
        if not entries:
            return
        lines, code = summary(entries)
        print("\n" + "\n".join(lines), file=sys.stderr)
        shutil.rmtree(sweep_dir / OUTCOMES, ignore_errors=True)
        if code:
            sys.exit(code)
