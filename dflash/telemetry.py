"""Progress of the ranks: a tqdm bar per rank, a progress file per rank, W&B from rank 0.

Ranks never exchange metrics through collectives (token-budgeted ranks run different numbers of
steps; a per-step all-reduce would deadlock at the tail). Each rank writes
`${run_dir}/progress/rank<r>.json`; rank 0 reads them all and logs totals and per-rank figures
to W&B, plus NVML utilization and memory of every GPU of its host.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from dflash.atomic import read_json, write_json_atomic
from dflash.config import WandbConfig

log = logging.getLogger(__name__)


@dataclass
class RankProgress:
    """What one rank has done in this launch (counts are cumulative since its start)."""

    rank: int
    launch_id: str
    planned_samples: int
    planned_tokens: int
    samples_done: int = 0
    tokens_done: int = 0
    padded_tokens_done: int = 0
    bytes_written: int = 0
    writer_queue_depth: int = 0
    compute_wait_s: float = 0.0
    """Seconds compute blocked on the writer queue (disk slower than compute)."""
    elapsed_s: float = 0.0
    warmup_s: float = 0.0
    """Elapsed seconds when the first batch was handed over: it carries the one-off costs
    (torch.compile, Triton's first compilations); rates after it are the steady state."""
    warmup_tokens: int = 0
    """Real tokens of that first batch."""
    finished: bool = False


class ProgressMeter:
    """One rank's meter: `update` after every batch; writes the progress file every
    `interval_s` and at `close`."""

    def __init__(self, progress_dir: Path, progress: RankProgress, interval_s: float):
        self.path = Path(progress_dir) / f"rank{progress.rank}.json"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.progress, self.interval_s = progress, interval_s
        self._start = time.monotonic()
        self._last_write = 0.0
        self.bar = tqdm(total=progress.planned_tokens, unit="tok", unit_scale=True,
                        desc=f"extract rank {progress.rank}", position=progress.rank,
                        dynamic_ncols=True, mininterval=1.0, leave=True)

    def update(self, samples: int, tokens: int, padded_tokens: int, bytes_written: int,
               queue_depth: int, compute_wait_s: float) -> bool:
        """Count one batch; returns True when a progress record was written."""
        p = self.progress
        now = time.monotonic()
        if p.samples_done == 0:
            p.warmup_s, p.warmup_tokens = now - self._start, tokens
        p.samples_done += samples
        p.tokens_done += tokens
        p.padded_tokens_done += padded_tokens
        p.bytes_written, p.writer_queue_depth, p.compute_wait_s = bytes_written, queue_depth, compute_wait_s
        self.bar.update(tokens)
        if now - self._last_write < self.interval_s:
            return False
        self._write(now)
        return True

    def _write(self, now: float) -> None:
        self.progress.elapsed_s = now - self._start
        self._last_write = now
        write_json_atomic(self.path, asdict(self.progress))

    def close(self, bytes_written: int, compute_wait_s: float) -> None:
        self.progress.bytes_written, self.progress.compute_wait_s = bytes_written, compute_wait_s
        self.progress.writer_queue_depth = 0
        self.progress.finished = True
        self._write(time.monotonic())
        self.bar.close()


def read_progress(progress_dir: Path, launch_id: str, world_size: int) -> list[dict[str, Any]]:
    """The progress records of this launch's ranks that exist so far."""
    records = []
    for rank in range(world_size):
        try:
            record = read_json(Path(progress_dir) / f"rank{rank}.json")
        except (FileNotFoundError, ValueError):
            continue
        if record.get("launch_id") == launch_id:
            records.append(record)
    return records


def _rate(count: float, record: dict[str, Any]) -> float:
    return count / record["elapsed_s"] if record["elapsed_s"] > 0 else 0.0


def steady_tokens_per_s(record: dict[str, Any]) -> float:
    """A rank's real tokens/s after its first batch (see `RankProgress.warmup_s`)."""
    seconds = record["elapsed_s"] - record.get("warmup_s", 0.0)
    return (record["tokens_done"] - record.get("warmup_tokens", 0)) / seconds if seconds > 0 else 0.0


def summarize(records: list[dict[str, Any]], world_size: int) -> dict[str, float]:
    """W&B metrics from the ranks' progress records: totals, per-rank rates, padding, ETA."""
    metrics: dict[str, float] = {}
    samples = sum(r["samples_done"] for r in records)
    tokens = sum(r["tokens_done"] for r in records)
    padded = sum(r["padded_tokens_done"] for r in records)
    written = sum(r["bytes_written"] for r in records)
    planned = sum(r["planned_tokens"] for r in records)
    elapsed = max((r["elapsed_s"] for r in records), default=0.0)
    for r in records:
        prefix = f"extract/rank{r['rank']}"
        metrics[f"{prefix}/throughput(samples/s)"] = _rate(r["samples_done"], r)
        metrics[f"{prefix}/throughput(tokens/s)"] = _rate(r["tokens_done"], r)
        metrics[f"{prefix}/steady_throughput(tokens/s)"] = steady_tokens_per_s(r)
        metrics[f"{prefix}/writer_queue_depth(batches)"] = r["writer_queue_depth"]
        metrics[f"{prefix}/writer_wait(s)"] = r["compute_wait_s"]
    tokens_per_s = sum(_rate(r["tokens_done"], r) for r in records)
    metrics.update({
        "extract/samples_done": samples,
        "extract/tokens_done": tokens,
        "extract/throughput(samples/s)": sum(_rate(r["samples_done"], r) for r in records),
        "extract/throughput(tokens/s)": tokens_per_s,
        "extract/steady_throughput(tokens/s)": sum(steady_tokens_per_s(r) for r in records),
        "extract/padding(fraction)": 1 - tokens / padded if padded else 0.0,
        "extract/write(bytes/s)": sum(_rate(r["bytes_written"], r) for r in records),
        "extract/writer_queue_depth(batches)": sum(r["writer_queue_depth"] for r in records),
        "extract/ranks_reporting": len(records) / world_size,
        "extract/eta(s)": (planned - tokens) / tokens_per_s if tokens_per_s > 0 else float("nan"),
        "extract/elapsed(s)": elapsed,
        "extract/bytes_written": written,
    })
    return metrics


def nvml_metrics() -> dict[str, float]:
    """Utilization (%) and memory used (GiB) of every GPU of this host; {} without NVML."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # no driver / no GPU: nothing to report
        return {}
    metrics: dict[str, float] = {}
    for index in range(pynvml.nvmlDeviceGetCount()):
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        utilization = pynvml.nvmlDeviceGetUtilizationRates(handle)
        memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
        metrics[f"gpu/{index}/utilization(%)"] = float(utilization.gpu)
        metrics[f"gpu/{index}/memory_used(GiB)"] = memory.used / 2**30
    return metrics


class WandbRun:
    """Rank 0's W&B run (mode from `WandbConfig`; `disabled`, or `enabled=False` on the other
    ranks, makes every call a no-op). The run lives in `${run_dir}/wandb`. Use as a context manager:
    it finishes the run on every path."""

    def __init__(self, cfg: WandbConfig, run_dir: Path, run_name: str, config: dict[str, Any],
                 enabled: bool = True):
        self.mode = cfg.mode or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
        self.run = None
        if self.mode == "disabled" or not enabled:
            return
        import wandb  # lazily: W&B is heavy and only rank 0 needs it

        Path(run_dir).mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=cfg.project, entity=cfg.entity, group=cfg.group, tags=cfg.tags,
                              name=run_name, dir=str(run_dir), mode=self.mode, config=config)
        # Each stage on its own x-axis, in one run.
        self.run.define_metric("extract/tokens_done")
        self.run.define_metric("extract/*", step_metric="extract/tokens_done")
        self.run.define_metric("gpu/*", step_metric="_timestamp")
        log.info("W&B run %s (%s) in %s", self.run.id, self.mode, self.run.dir)

    def define_step_axis(self, stage: str) -> None:
        """Plot `<stage>/*` against `<stage>/step`."""
        if self.run is not None:
            self.run.define_metric(f"{stage}/step")
            self.run.define_metric(f"{stage}/*", step_metric=f"{stage}/step")

    def log(self, metrics: dict[str, Any]) -> None:
        if self.run is not None:
            self.run.log(metrics)

    def summary(self, values: dict[str, Any]) -> None:
        if self.run is not None:
            self.run.summary.update(values)

    def __enter__(self) -> "WandbRun":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self.run is not None:
            self.run.finish(exit_code=1 if exc_type else 0)
