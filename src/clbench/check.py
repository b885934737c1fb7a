"""``clbench check <overrides>``: whether the run those overrides describe could start here, and nothing else.

It composes and validates the config as ``clbench`` would, then says, a line each, what the run is, where each
dataset and the weights would come from (or why they cannot), and the device; it trains, downloads and writes
nothing. Exit code 0 when everything is there, 2 when anything is missing or the config is refused.
"""

from __future__ import annotations

import sys

from hydra.errors import HydraException

from clbench.comparable import benchmark_label, method_name
from clbench.config import RunConfig, config_dir, validate
from clbench.errors import ClbenchError
from clbench.hints import explain
from clbench.prerequisites import datasets_status, weights_status


def composed(argv: list[str]) -> RunConfig:
    """The config ``clbench <argv>`` would run, composed by Hydra and validated by clbench."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        return validate(compose("config", overrides=argv))


def device_line(cfg: RunConfig) -> str:
    """Where the run would train, and what a CPU means for it."""
    import torch

    if torch.cuda.is_available() and cfg.trainer.device != "cpu":
        return f"{torch.cuda.get_device_name()} (CUDA)"
    why = "trainer.device=cpu" if cfg.trainer.device == "cpu" else "no CUDA device visible"
    large = cfg.backbone.img_size >= 224 and not cfg.smoke  # a paper's backbone: hours a task on a CPU
    note = "; smoke=true takes it end to end here in a minute or two, to try it before a GPU" if large else ""
    return f"the CPU ({why}){note}"


def report(cfg: RunConfig) -> tuple[list[str], int]:
    """The lines of the check and how many prerequisites are missing."""
    tasks = cfg.data.num_tasks or cfg.data.tasks
    run = f"{method_name(cfg.method_target)} on {benchmark_label(vars(cfg.data))} ({tasks} tasks), {cfg.backbone.name}"
    lines = [f"  config   valid: {run}{', smoke run' if cfg.smoke else ''}"]
    statuses = [("data", s) for s in datasets_status(cfg.data)] or [("data", (True, f"{cfg.data.source}: built in"))]
    statuses.append(("weights", weights_status(cfg.backbone)))
    for what, (there, line) in statuses:
        lines.append(f"  {what:<8} {'ready' if there else 'MISSING'}: {line}")
    lines.append(f"  device   {device_line(cfg)}")
    return lines, sum(not there for _, (there, _) in statuses)


def main(argv: list[str]) -> int:
    """Check the run ``argv`` describes; print what it found; the exit code."""
    if {"-h", "--help"} & set(argv):
        print(f"usage: clbench check [OVERRIDES...]\n\n{__doc__.strip()}")
        return 0
    if {"-m", "--multirun"} & set(argv):
        print("clbench check: checks one run: drop -m and check each setting of the sweep.", file=sys.stderr)
        return 2
    try:
        cfg = composed(argv)
    except HydraException as err:
        print(f"clbench check: {explain(err, argv) or str(err).strip()}", file=sys.stderr)
        return 2
    except ClbenchError as err:
        print(f"clbench check: refused: {err}", file=sys.stderr)
        return 2
    lines, missing = report(cfg)
    print(f"clbench check {' '.join(argv)}".rstrip(), *lines, sep="\n")
    if missing:
        print(f"Not ready: {missing} missing (above). Nothing was run, downloaded or written.")
        return 2
    print("Ready: the run can start here. Nothing was run, downloaded or written.")
    return 0
