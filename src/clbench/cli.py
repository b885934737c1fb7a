"""`clbench`: compose the config with Hydra, validate it, run :func:`clbench.loop.train`. Nothing else."""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import shutil
import signal
import sys
from pathlib import Path
from typing import ClassVar

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from hydra.utils import get_class
from omegaconf import DictConfig, OmegaConf

from clbench.config import RunConfig, config_dir, full_config, validate
from clbench.errors import ClbenchError, ConfigError, DataError, Interrupted, Preempted
from clbench.files import (
    CHECKPOINT_FILE,
    LOCK_FILE,
    PID_FILE,
    began_writing,
    check_new_run,
    check_writable,
    existing_run,
    lock_run_folder,
    unlock_run_folder,
    write_atomic,
)
from clbench.hints import HeldStderr, explain
from clbench.inert import inert_settings, overridden_keys
from clbench.rerun import left_behind, resume_command
from clbench.sweep_folders import remember_swept
from clbench.sweep_summary import DONE, FAILED, REFUSED, STARTED, STOPPED, record, said_before

log = logging.getLogger("clbench")


class RunFolderGuard(Callback):
    """Before Hydra writes anything into the output folder (registered in conf/config.yaml under hydra.callbacks):
    refuse an invalid config, a folder that cannot be written, a run folder another clbench process holds (the lock
    stays with this process until it exits), ``resume=true`` where there is no checkpoint to resume, and a new run in
    a folder that holds a run already; each with one clear paragraph, exit 2. What the start of a job writes is kept
    track of (the .hydra files, clbench.log, the lock and PID files; a folder made for it), so that a run refused
    later (another config than the checkpoint's, missing data, a value only the built model can refuse, a checkpoint
    that does not fit) or a finished run resumed (nothing to do) leaves the folder byte for byte as it was, and no
    folder where there was none: Hydra writes them before the run can build anything."""

    before: ClassVar[dict[Path, bytes | None]] = {}
    folder: ClassVar[Path | None] = None
    made: ClassVar[Path | None] = None  # the topmost folder made for this job (None: the run folder existed)

    def on_run_start(self, config: DictConfig, **kwargs: object) -> None:
        if int(os.environ.get("RANK", "0")) > 0:  # torchrun's other ranks write nothing
            return
        folder = Path(str(config.hydra.run.dir))
        RunFolderGuard.before, RunFolderGuard.folder, RunFolderGuard.made = {}, None, None  # this job's folder only
        try:
            validate(OmegaConf.masked_copy(config, [k for k in config if k != "hydra"]))
            resume = resume_setting(config.get("resume"))
            if resume is True and not (folder / CHECKPOINT_FILE).is_file():
                raise DataError(
                    f"Cannot resume: {folder / CHECKPOINT_FILE} does not exist (no run wrote a checkpoint there). "
                    "Point hydra.run.dir at the run's folder, or drop resume=true to start a new run."
                )
            check_new_run(folder, resume)
            made = topmost_missing(folder)
            check_writable(folder)
            hydra_files = {folder / ".hydra" / f"{name}.yaml" for name in ("config", "hydra", "overrides")}
            kept = [*hydra_files, *(folder / ".hydra").glob("*.yaml"), folder / "clbench.log"]
            kept += [folder / PID_FILE, folder / LOCK_FILE]
            RunFolderGuard.before = {p: p.read_bytes() if p.is_file() else None for p in kept}
            RunFolderGuard.folder, RunFolderGuard.made = folder, made
            lock_run_folder(folder)
        except ClbenchError as err:
            report(str(err))
            sys.exit(2)

    def on_multirun_start(self, config: DictConfig, **kwargs: object) -> None:
        searched = list(config.hydra.sweeper.get("params") or {})
        remember_swept(list(config.hydra.overrides.task), [str(key) for key in searched])
        folder = Path(str(config.hydra.sweep.dir))
        try:
            check_new_sweep(folder, resume_setting(config.get("resume")))
            check_writable(folder)
        except ClbenchError as err:
            report(str(err))
            sys.exit(2)

    @classmethod
    def put_back(cls) -> None:
        """Give the folder of a refused (or finished and resumed) run back as it was: the run folder's lock released,
        the files the job rewrote restored (or removed, where the job created them), a folder made for the job
        removed. A run that began to write the folder keeps it."""
        if cls.folder is None or began_writing(cls.folder):
            return
        unlock_run_folder(cls.folder, keep_pid=True)
        if cls.made is not None:
            remove_made(cls.folder, cls.made)
            return
        for path, data in cls.before.items():
            if data is not None:
                write_atomic(path, data)
            elif path.is_file():
                path.unlink()
        hydra_dir = cls.folder / ".hydra"
        if hydra_dir.is_dir() and not any(hydra_dir.iterdir()):  # made for the job: it held none of these files
            hydra_dir.rmdir()


def topmost_missing(folder: Path) -> Path | None:
    """The topmost of ``folder`` and its parents that does not exist (None where ``folder`` exists)."""
    missing = None
    for path in (folder, *folder.parents):
        if path.exists():
            return missing
        missing = path
    return missing


def remove_made(folder: Path, made: Path) -> None:
    """Remove ``folder`` and its parents up to ``made``, made for a job that was refused; a parent another job has
    written into since is kept."""
    shutil.rmtree(folder, ignore_errors=True)
    for path in folder.parents:
        if not path.is_relative_to(made):
            return
        try:
            path.rmdir()
        except OSError:  # not empty: another job's folder is in it
            return


def check_new_sweep(folder: Path, resume: bool | str) -> None:
    """A new sweep (``resume`` false) is refused in a sweep folder that holds jobs' runs already, before anything is
    written; with ``resume=auto`` each job finds its own folder's run (finished: kept as it is, interrupted:
    continued)."""
    held = sorted(d.name for d in folder.iterdir() if d.is_dir() and existing_run(d)) if folder.is_dir() else []
    if held and resume is False:
        raise ConfigError(
            f"The sweep folder {folder} holds runs already ({len(held)} jobs' folders: {', '.join(held[:3])}"
            f"{', ...' if len(held) > 3 else ''}), and a new sweep is never written over them: rerun it with "
            "resume=auto (finished jobs are kept as they are, interrupted ones continue), or choose another folder "
            "with hydra.sweep.dir=PATH."
        )


def remove_refused_job(folder: Path) -> None:
    """A sweep's job refused before it began writing leaves no folder of its own: where its folder holds nothing but
    what the job's start wrote (.hydra, clbench.log, the lock and PID files), it is removed."""
    start = {".hydra", "clbench.log", LOCK_FILE, PID_FILE}
    if folder.is_dir() and not began_writing(folder) and {p.name for p in folder.iterdir()} <= start:
        shutil.rmtree(folder, ignore_errors=True)


def resume_setting(resume: object) -> object:
    """``resume`` as a job acts on it: a SLURM job requeued after preemption or a time limit (SLURM_RESTART_COUNT >= 1)
    resumes from the checkpoint in its folder where there is one (``auto``) instead of starting over."""
    if resume is False and int(os.environ.get("SLURM_RESTART_COUNT") or 0) > 0:
        return "auto"
    return resume


def requeued(cfg: RunConfig) -> RunConfig:
    """A requeued SLURM job's config: ``resume=auto`` (:func:`resume_setting`)."""
    resume = resume_setting(cfg.resume)
    if resume != cfg.resume:
        log.info("requeued SLURM job: resume=auto")
        return dataclasses.replace(cfg, resume=resume)
    return cfg


def hand_on(signum: int) -> None:
    """Give a stop signal to the handler a launcher installed for it (submitit requeues the job on SIGUSR2), now
    that the checkpoint is written. Default handlers are left alone: the run has already stopped cleanly."""
    handler = signal.getsignal(signum)
    if callable(handler) and handler not in (signal.default_int_handler, interrupted):
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


def share_cores(launcher: DictConfig) -> None:
    """Parallel local jobs (hydra/launcher=joblib) split the machine's cores between them: n jobs x torch threads <=
    cores. torch would otherwise give every job a thread per core, and oversubscribed processes spin (measured on 2
    cores: 40x slower than alone)."""
    if "joblib" not in str(launcher.get("_target_", "")):
        return
    import torch

    cores = len(os.sched_getaffinity(0))
    n_jobs = int(launcher.get("n_jobs") or -1)
    jobs = n_jobs if n_jobs > 0 else max(1, cores + 1 + n_jobs)  # joblib's convention: -1 = one job per core
    torch.set_num_threads(max(1, cores // min(jobs, cores)))


def interrupted(signum: int, _frame: object) -> None:
    raise Interrupted(
        f"Interrupted: stopped by {signal.Signals(signum).name} outside training (while starting up or finishing), "
        "so no checkpoint was due; run the same command again with resume=auto to continue where the folder has one."
    )


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


def warn_inert(cfg: RunConfig, overrides: list[str]) -> None:
    """Say which settings of the run change nothing (:mod:`clbench.inert`), before it starts."""
    method_cls = get_class(cfg.method_target)
    for line in inert_settings(cfg, overridden_keys(overrides), method_cls.unused_keys(cfg.method)):
        report(line, logging.WARNING)


@hydra.main(version_base="1.3", config_path=str(config_dir()), config_name="config")
def app(cfg: DictConfig) -> float | None:
    """One job. Returns ``objective`` (e.g. the validation CIL final accuracy), the value a Hydra sweeper (Optuna)
    optimises, or None without one; a job that fails in a sweep returns NaN, which Optuna records as a failed
    trial, and records its outcome for the sweep's summary (:mod:`clbench.sweep_summary`)."""
    HeldStderr.release()  # the config composed: what Hydra said meanwhile (warnings) is said now
    hydra_cfg = HydraConfig.get()
    multirun = hydra_cfg.mode == RunMode.MULTIRUN
    folder, overrides = Path(hydra_cfg.runtime.output_dir), list(hydra_cfg.overrides.task)

    def ended(outcome: str, reason: str | None = None) -> None:
        if multirun:
            record(Path(hydra_cfg.sweep.dir), int(hydra_cfg.job.num), outcome, reason)

    ended(STARTED)
    try:
        run_cfg = requeued(validate(cfg))
        check_sweep_objective(run_cfg, str(hydra_cfg.sweeper.get("_target_", "")))
        warn_inert(run_cfg, overrides)
        if multirun:
            share_cores(hydra_cfg.launcher)
        from clbench import distributed  # heavy imports (torch, timm) only once the config is known to be valid
        from clbench.loop import train

        ranks = distributed.init(run_cfg.trainer.device)
        run_dir = Path(ranks.broadcast(str(folder)))  # torchrun: rank 0's folder for every rank
        if not multirun and ranks.is_main:
            warn_left_behind(run_cfg, run_dir, overrides)
        results = train(run_cfg, run_dir, name=hydra_cfg.job.override_dirname or None)
        distributed.leave()
        RunFolderGuard.put_back()  # a finished run resumed: nothing was written, its folder is given back as it was
        ended(DONE)
        value = results.objective["value"] if results.objective else None
        return math.nan if run_cfg.objective is not None and value is None else value
    except Preempted as err:
        distributed.leave()  # every rank stops at the same step (Ranks.agree) and leaves with the others
        print(
            f"\nclbench: {err}. Its checkpoint is in {folder}; to go on where it stopped, run:\n"
            f"  {resume_command(folder, overrides)}",
            file=sys.stderr,
        )
        ended(STOPPED, str(err))
        hand_on(err.signum)
        if multirun:
            return math.nan
        sys.exit(0)
    except ClbenchError as err:
        outcome = FAILED if began_writing(folder) else REFUSED
        first = said_before(str(err), int(hydra_cfg.job.num)) if multirun else None
        report(str(err) if first is None else f"job {hydra_cfg.job.num} {outcome}: as job {first}, above.")
        ended(outcome, str(err))
        RunFolderGuard.put_back()
        if multirun:  # one bad job must not end the sweep; its results.json (if any) says failed
            remove_refused_job(folder)
            return math.nan
        sys.exit(2)
    except Exception as err:
        if not multirun:
            raise
        log.exception("job %s failed; the sweep goes on", hydra_cfg.job.num)
        ended(FAILED, f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}")
        return math.nan


def warn_left_behind(cfg: RunConfig, run_dir: Path, overrides: list[str]) -> None:
    """A new run (not resumed) whose command stopped before, in another folder: say so, and how to resume that one
    (:mod:`clbench.rerun`)."""
    resuming = cfg.resume is True or (cfg.resume == "auto" and (run_dir / "checkpoint.pt").is_file())
    said = None if resuming else left_behind(run_dir, full_config(cfg), overrides)
    if said:
        report(said, logging.WARNING)


def main() -> None:
    if sys.argv[1:2] == ["check"]:  # `clbench check <overrides>`: the run's prerequisites, and nothing else
        from clbench.check import main as check

        sys.exit(check(sys.argv[2:]))
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # torchrun's ranks, read without importing torch (--help stays fast)
        if {"-m", "--multirun"} & set(sys.argv[1:]):
            sys.exit("clbench: torchrun runs one job over several processes; run sweeps with -m without torchrun.")
        if int(os.environ.get("RANK", "0")) > 0:  # rank 0 owns the run folder and the logs; its path is broadcast
            sys.argv += ["hydra.output_subdir=null", "hydra/job_logging=disabled", "hydra.run.dir=."]
    for sig in (signal.SIGINT, signal.SIGTERM):  # the training loop installs its own handlers while it runs
        signal.signal(sig, interrupted)
    # A clbench process logs through a W&B service of its own: one inherited from the process that started it
    # (WANDB_SERVICE, set by any wandb.init there) keeps a killed run's stream open, and refuses its resume ("run ID
    # ... is in use").
    os.environ.pop("WANDB_SERVICE", None)
    held = HeldStderr.hold()
    try:
        app()
    except SystemExit as err:  # Hydra reports a bad override or config (held, not printed yet) with exit code 1
        if err.code == 1 and isinstance(err.__context__, HydraException):
            hint = explain(err.__context__, sys.argv[1:])
            held.release(instead=f"clbench: {hint}\n" if hint else None)
            sys.exit(2)  # a user error, as every other one
        raise
    finally:
        held.release()


if __name__ == "__main__":
    main()
