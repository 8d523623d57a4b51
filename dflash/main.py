"""Entry point: resolve the Hydra config and run `stage=`.

    accelerate launch --config_file launch/cpu_2proc.yaml dflash/main.py stage=extract
    python dflash/main.py stage=extract          # one process

Every rank runs this file; each resolves the same config and so the same run dir
(`${output_root}/${run_name}`, no timestamps).
"""

from __future__ import annotations

import logging
import sys

from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from dflash.config import ConfigError, register_configs, resolve_config

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
    if cfg.stage == "prepare":
        from dflash.stages import prepare as stage
    else:
        from dflash.stages import extract as stage
    stage.run(cfg)


if __name__ == "__main__":
    main()
