"""`clbench`: compose the config with Hydra, validate it, run :func:`clbench.run.train`. Nothing else."""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import signal
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig

from clbench.config import RunConfig, register_schemas, validate
from clbench.errors import ClbenchError, ConfigError, Preempted
from clbench.files import check_writable


def config_dir() -> Path:
    """The configs shipped in the wheel (clbench/conf), or the source tree's conf/ in an editable install."""
    packaged = Path(__file__).resolve().parent / "conf"
    return packaged if packaged.is_dir() else Path(__file__).resolve().parents[2] / "conf"


log = logging.getLogger("clbench")
register_schemas()


class OutputFolderCheck(Callback):
    """Refuse an output folder that cannot be written with one clear paragraph (exit 2) before Hydra creates it,
    which would otherwise fail with a traceback. Registered in conf/config.yaml under hydra.callbacks."""

    def on_run_start(self, config: DictConfig, **kwargs: object) -> None:
        self.check(config.hydra.run.dir)

    def on_multirun_start(self, config: DictConfig, **kwargs: object) -> None:
        self.check(config.hydra.sweep.dir)

    @staticmethod
    def check(folder: str) -> None:
        try:
            check_writable(Path(str(folder)))
        except ClbenchError as err:
            report(str(err))
            sys.exit(2)


def requeued(cfg: RunConfig) -> RunConfig:
    """A SLURM job requeued after preemption or a time limit (SLURM_RESTART_COUNT >= 1) resumes from the
    checkpoint in its folder where there is one (``resume=auto``) instead of starting over."""
    if cfg.resume is False and int(os.environ.get("SLURM_RESTART_COUNT") or 0) > 0:
        log.info("requeued SLURM job: resume=auto")
        return dataclasses.replace(cfg, resume="auto")
    return cfg


def hand_on(signum: int) -> None:
    """Give a stop signal to the handler a launcher installed for it (submitit requeues the job on SIGUSR2), now
    that the checkpoint is written. Default handlers are left alone: the run has already stopped cleanly."""
    handler = signal.getsignal(signum)
    if callable(handler) and handler is not signal.default_int_handler:
        handler(signum, None)


def report(message: str, level: int = logging.ERROR) -> None:
    """A user error (or warning): one paragraph on the terminal's stderr, and the same line in the run folder's log
    (not a second time on the terminal through the log's console handler)."""
    record = log.makeRecord(log.name, level, __file__, 0, "%s", (message,), None)
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)
    prefix = "clbench: warning: " if level == logging.WARNING else "clbench: "
    print(f"\n{prefix}{message}", file=sys.stderr)


def check_sweep_objective(cfg: RunConfig, sweeper: str) -> None:
    """A searching sweeper (Optuna) needs an objective; one that reads the test set is allowed only with
    ``objective_on_test=true`` (see :func:`clbench.config.check_objective`), and warned about."""
    if "optuna" in sweeper.lower() and cfg.objective is None:
        raise ConfigError(
            "An Optuna sweep needs `objective=`: e.g. `objective=validation.cil.final_acc data.val_fraction=0.1` "
            "(the hparams_search presets set both)."
        )
    if cfg.objective is not None and not cfg.objective.startswith("validation."):
        report(
            f"objective={cfg.objective} reads the TEST set (objective_on_test=true): a search that selects by it "
            "overstates the result; report the selected setting on data it was not chosen on.",
            logging.WARNING,
        )


@hydra.main(version_base="1.3", config_path=str(config_dir()), config_name="config")
def app(cfg: DictConfig) -> float | None:
    """One job. Returns ``objective`` (e.g. the validation CIL final accuracy), the value a Hydra sweeper (Optuna)
    optimises, or None without one; a job that fails in a sweep returns NaN, which Optuna records as a failed
    trial."""
    hydra_cfg = HydraConfig.get()
    multirun = hydra_cfg.mode == RunMode.MULTIRUN
    try:
        run_cfg = requeued(validate(cfg))
        check_sweep_objective(run_cfg, str(hydra_cfg.sweeper.get("_target_", "")))
        from clbench import distributed  # heavy imports (torch, timm) only once the config is known to be valid
        from clbench.run import train

        ranks = distributed.init(run_cfg.trainer.device)
        run_dir = Path(ranks.broadcast(hydra_cfg.runtime.output_dir))  # torchrun: rank 0's folder for every rank
        results = train(
            run_cfg,
            run_dir,
            name=hydra_cfg.job.override_dirname or None,
        )
        value = results.objective["value"] if results.objective else None
        return math.nan if run_cfg.objective is not None and value is None else value
    except Preempted as err:
        print(
            f"\nclbench: {err}. A checkpoint is in {hydra_cfg.runtime.output_dir}; continue with the same command and "
            "resume=true (and hydra.run.dir set to that folder).",
            file=sys.stderr,
        )
        hand_on(err.signum)
        if multirun:
            return math.nan
        sys.exit(0)
    except ClbenchError as err:
        report(str(err))
        if multirun:  # one bad job must not end the sweep; its results.json (if any) says failed
            return math.nan
        sys.exit(2)
    except Exception:
        if not multirun:
            raise
        log.exception("job %s failed; the sweep goes on", hydra_cfg.job.num)
        return math.nan


def main() -> None:
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # torchrun's ranks, read without importing torch (--help stays fast)
        if {"-m", "--multirun"} & set(sys.argv[1:]):
            sys.exit("clbench: torchrun runs one job over several processes; run sweeps with -m without torchrun.")
        if int(os.environ.get("RANK", "0")) > 0:  # rank 0 owns the run folder and the logs; its path is broadcast
            sys.argv += ["hydra.output_subdir=null", "hydra/job_logging=disabled", "hydra.run.dir=."]
    app()


if __name__ == "__main__":
    main()
