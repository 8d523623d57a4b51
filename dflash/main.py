"""Entry point: resolve the Hydra config and run `stage=`.

    accelerate launch --config_file launch/cpu_2proc.yaml dflash/main.py stage=extract
    python dflash/main.py stage=extract          # one process

Every rank runs this file; each resolves the same config and so the same run dir
(`${output_root}/${run_name}`, no timestamps).
"""

from __future__ import annotations

import importlib
import logging
import sys
from dataclasses import asdict

from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from dflash.config import STAGE_SEQUENCE, Config, ConfigError, register_configs, resolve_config
from dflash.runtime import close_runtime, init_runtime
from dflash.telemetry import WandbRun

log = logging.getLogger("dflash")

register_configs()


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(dict_cfg: DictConfig) -> None:
    # The per-rank log files (conf/hydra/job_logging/dflash.yaml) open lazily, in here.
    (Path(HydraConfig.get().runtime.output_dir) / "logs").mkdir(parents=True, exist_ok=True)
    try:
        cfg = resolve_config(dict_cfg)
    except ConfigError as exc:
        log.error("%s", exc)
        sys.exit(2)
    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode == RunMode.MULTIRUN:  # each job of a sweep in its own subdir, one W&B group
        cfg.run_dir = hydra_cfg.runtime.output_dir
        cfg.run_name = f"{cfg.run_name}/{hydra_cfg.sweep.subdir}"
        cfg.wandb.group = cfg.wandb.group or Path(hydra_cfg.sweep.dir).name
    run_stages(cfg)


def run_stages(cfg: Config) -> None:
    """Run the stages of `cfg.stage` in order, in this process: one runtime and one W&B run
    (rank 0) for all of them. A failure is marked for the other ranks, which stop waiting."""
    rt = init_runtime(cfg.run_dir, cfg.device, cfg.barrier.timeout_s, cfg.barrier.poll_s)
    try:
        with WandbRun(cfg.wandb, rt.run_dir, cfg.run_name, asdict(cfg), enabled=rt.is_main) as wandb_run:
            for name in STAGE_SEQUENCE[cfg.stage]:
                stage = importlib.import_module(f"dflash.stages.{name}")
                stage.run(cfg, rt, wandb_run)
    except BaseException as exc:
        rt.mark_failed(exc)
        raise


if __name__ == "__main__":
    main()  # every job of a multirun shares this process and its process group
    close_runtime()
