"""Run folders named by what they hold: a single run's by the benchmark it measured (``clbench_benchmark``:
``digits_5tasks_first3`` for the first 3 of its 5 tasks), a sweep job's by its number and the swept overrides
(``3_method.lam=0.9,method.tau=1.0``), not its number alone.

Hydra knows which overrides a command line sweeps only when the sweep starts (:func:`remember_swept`, called from
the run-folder guard's ``on_multirun_start``); the jobs, possibly other processes (joblib, SLURM), read the keys from
the environment they inherit. The folder is resolved from ``hydra.sweep.subdir`` by the resolver registered here.
"""

from __future__ import annotations

import os

from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import ListConfig, OmegaConf

from clbench.comparable import benchmark_label

SWEPT_ENV = "CLBENCH_SWEPT_KEYS"
MAX_NAME = 120  # characters of overrides in a folder name; the job number keeps shortened names apart


def remember_swept(overrides: list[str], searched: list[str]) -> None:
    """Record the keys a sweep varies: those swept on its command line (``a=1,2``, ``glob(...)``, ``range(...)``)
    and those a searching sweeper draws (``searched``: Optuna's ``hydra.sweeper.params``)."""
    parsed = OverridesParser.create().parse_overrides(overrides)
    swept = [o.key_or_group for o in parsed if o.is_sweep_override()] + searched
    os.environ[SWEPT_ENV] = ",".join(dict.fromkeys(swept))


def job_folder(number: int, overrides: ListConfig | list[str]) -> str:
    """``<number>_<the job's swept overrides>``, with ``/`` replaced (one folder, never nested) and cut to
    :data:`MAX_NAME` characters; the number alone where nothing is known to be swept."""
    swept = set(filter(None, os.environ.get(SWEPT_ENV, "").split(",")))
    chosen = [str(o) for o in overrides if str(o).split("=", 1)[0].lstrip("+~") in swept]
    name = ",".join(chosen).replace("/", "-")[:MAX_NAME]
    return f"{number}_{name}" if name else str(number)


def benchmark_folder(name: str, num_tasks: int | None, tasks: int | None) -> str:
    """The data config's name as a folder name: :func:`clbench.comparable.benchmark_label`."""
    return benchmark_label({"name": name, "tasks": tasks, "num_tasks": num_tasks})


OmegaConf.register_new_resolver("clbench_job_folder", job_folder, replace=True)
OmegaConf.register_new_resolver("clbench_benchmark", benchmark_folder, replace=True)
