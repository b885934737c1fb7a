"""Going on with a stopped run: the literal command that resumes it, and the stopped run a new one would leave behind.

A run stopped by Ctrl-C or a stop signal writes its checkpoint and prints :func:`resume_command`, the command to paste.
The same command run again instead starts a new run in a new folder (the default folder is named by the time it
starts): clbench does not resume on its own, since the new run may be meant; it says, before any work, which earlier
stopped run of the same setting and seed it leaves behind (:func:`stopped_before`), and how to resume that one.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from clbench.comparable import setting

TIMED = re.compile(r"\d{2}-\d{2}-\d{2}_(.+)")  # the default run folder: outputs/<date>/<HH-MM-SS>_<method>_<benchmark>
NOT_CARRIED = ("resume", "hydra.run.dir")  # what the resume command sets itself


def program() -> list[str]:
    """The words that started this clbench: ``clbench`` where that is on the PATH, else this Python with ``-m``; under
    torchrun, torchrun with this node's process count."""
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("WORLD_SIZE") or 1)
    if ranks > 1:
        return ["torchrun", "--standalone", f"--nproc_per_node={ranks}", "-m", "clbench"]
    script = Path(sys.argv[0])
    if script.name == "clbench":
        on_path = shutil.which("clbench")
        return ["clbench"] if on_path and Path(on_path).resolve() == script.resolve() else [str(script)]
    return [sys.executable, "-m", "clbench"]


def resume_command(folder: Path, overrides: list[str]) -> str:
    """The command that resumes the run in ``folder``: its overrides (the job's own, in a sweep), ``resume=true`` and
    ``hydra.run.dir`` set to the folder, quoted for a POSIX shell."""
    kept = [o for o in overrides if o.lstrip("+~").split("=", 1)[0] not in NOT_CARRIED]
    return shlex.join([*program(), *kept, "resume=true", f"hydra.run.dir={folder.resolve()}"])


def stopped_before(run_dir: Path, config: Mapping[str, Any]) -> tuple[Path, dict[str, Any]] | None:
    """The newest run folder beside ``run_dir`` (the default layout, one folder a day) of the same setting and seed as
    ``config`` that stopped with a checkpoint to resume from, and its results.json; None where there is none or
    ``run_dir`` is not of the default layout."""
    named = TIMED.fullmatch(run_dir.name)
    if named is None:
        return None
    wanted = (setting(config), config.get("seed"))
    for folder in sorted(run_dir.parent.parent.glob(f"*/*_{named.group(1)}"), key=lambda f: f.name, reverse=True):
        if folder == run_dir or not (folder / "checkpoint.pt").is_file():
            continue
        try:
            run = json.loads((folder / "results.json").read_text())
        except (OSError, ValueError):
            continue
        if same_run(run, wanted):
            return folder, run
    return None


def same_run(run: Any, wanted: tuple[dict[str, Any], Any]) -> bool:
    """Whether a results.json is of a stopped run of the ``wanted`` (setting, seed)."""
    if not isinstance(run, dict) or run.get("status") != "interrupted" or not isinstance(run.get("config"), dict):
        return False
    return (setting(run["config"]), run["config"].get("seed")) == wanted


def left_behind(run_dir: Path, config: Mapping[str, Any], overrides: list[str]) -> str | None:
    """What a new run says when the same command stopped before (:func:`stopped_before`); None otherwise."""
    found = stopped_before(run_dir, config)
    if found is None:
        return None
    folder, run = found
    trained = len(run.get("acc_matrix", {}).get("til") or [])
    return (
        f"this command's run in {folder} stopped after {trained} of its {len(run.get('tasks') or [])} tasks, with a "
        f"checkpoint; this is a new run, in {run_dir}. To go on with the stopped one instead, stop this one (Ctrl-C) "
        f"and run:\n  {resume_command(folder, overrides)}"
    )
