"""stage=prepare: the target checkpoint and the prepared dataset, nothing else.

    accelerate launch dflash/main.py stage=prepare [data=file data.path=...]

Builds the embedded target at `model.path` if `model.init=embedded`, then validates the source
data (or generates synthetic conversations with the target) into `data.prepared_dir`
(default `${run_dir}/prepared`). Rank 0 works; the other ranks wait. stage=extract does the same
first when something is missing.
"""

from __future__ import annotations

from dflash.config import Config
from dflash.data.prepare import ensure_prepared
from dflash.runtime import Runtime
from dflash.target.load import ensure_target
from dflash.telemetry import WandbRun


def run(cfg: Config, rt: Runtime, wandb_run: WandbRun) -> None:
    def prepare() -> None:
        ensure_target(cfg.model)
        ensure_prepared(cfg.data, cfg.model, rt.device)

    rt.main_first("prepared", prepare)
