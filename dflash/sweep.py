"""Hydra multirun support: every job of a sweep runs in its own deterministic subdir, and a
callback writes the sweep's summary.

    accelerate launch --config_file launch/cpu_2proc.yaml dflash/main.py -m stage=bench \
        extract.token_budget=8000,12000,20000

Under `accelerate launch` every rank runs the same sweep, job by job in the same order (Hydra's
basic launcher runs them sequentially), so the ranks stay together; the sweep dir
`${output_root}/${run_name}-sweep` has no timestamp, so all ranks agree on it, and each job's
subdir is its overrides (`extract.token_budget=8000`). W&B runs of one sweep share a group.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from dflash.atomic import write_bytes_atomic

log = logging.getLogger(__name__)

SUMMARY = "sweep_summary.md"


class SweepSummary(Callback):
    """After the last job (rank 0): one table of every job's bench.json rows, fastest first, in
    `<sweep dir>/sweep_summary.md` (nothing when no job ran stage=bench)."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if int(os.environ.get("RANK", "0")) != 0:
            return
        sweep_dir = Path(config.hydra.sweep.dir)
        rows = []
        for job_dir in sorted(p for p in sweep_dir.iterdir() if p.is_dir()):
            bench = job_dir / "bench.json"
            if bench.exists():
                for row in json.loads(bench.read_text())["rows"]:
                    rows.append({"job": job_dir.name, **row})
        if not rows:
            return
        rows.sort(key=lambda r: -r["tokens/s"])
        keys = ["job", "variant", "tokens/s", "MFU", "x baseline", "padding", "peak GiB"]
        lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
        for r in rows:
            cells = [r["job"], r["variant"], f"{r['tokens/s']:,.0f}", f"{r['MFU']:.1%}", f"{r['x baseline']:.2f}",
                     f"{r['padding']:.1%}", f"{r['peak GiB']:.1f}"]
            lines.append("| " + " | ".join(cells) + " |")
        write_bytes_atomic(sweep_dir / SUMMARY, ("\n".join(lines) + "\n").encode())
        log.info("sweep summary (fastest first) in %s:\n%s", sweep_dir / SUMMARY, "\n".join(lines))
