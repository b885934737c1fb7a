"""`clbench`: compose the config with Hydra, validate it, run :func:`clbench.run.train`. Nothing else."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from clbench.config import register_schemas, validate
from clbench.errors import ClbenchError, Preempted


def config_dir() -> Path:
    """The configs shipped in the wheel (clbench/conf), or the source tree's conf/ in an editable install."""
    packaged = Path(__file__).resolve().parent / "conf"
    return packaged if packaged.is_dir() else Path(__file__).resolve().parents[2] / "conf"


log = logging.getLogger("clbench")
register_schemas()


@hydra.main(version_base="1.3", config_path=str(config_dir()), config_name="config")
def app(cfg: DictConfig) -> float | None:
    """One job: returns the CIL final accuracy (the value a Hydra sweeper optimises)."""
    hydra_cfg = HydraConfig.get()
    multirun = hydra_cfg.mode == RunMode.MULTIRUN
    try:
        run_cfg = validate(cfg)
        from clbench.run import train  # heavy imports (torch, timm) only once the config is known to be valid

        results = train(
            run_cfg,
            Path(hydra_cfg.runtime.output_dir),
            OmegaConf.to_container(cfg, resolve=True),
            group=Path(hydra_cfg.sweep.dir).name if multirun else None,
            name=hydra_cfg.job.override_dirname or None,
        )
        return results.metrics()["cil"]["final_acc"]
    except Preempted as err:
        print(
            f"\nclbench: {err}. A checkpoint is in {hydra_cfg.runtime.output_dir}; continue with the same command and "
            "resume=true (and hydra.run.dir set to that folder).",
            file=sys.stderr,
        )
        if multirun:
            return None
        sys.exit(0)
    except ClbenchError as err:
        log.error("%s", err)
        print(f"\nclbench: {err}", file=sys.stderr)
        if multirun:  # one bad job must not end the sweep; its results.json (if any) says failed
            return None
        sys.exit(2)
    except Exception:
        if not multirun:
            raise
        log.exception("job %s failed; the sweep goes on", hydra_cfg.job.num)
        return None


def main() -> None:
    app()


if __name__ == "__main__":
    main()
