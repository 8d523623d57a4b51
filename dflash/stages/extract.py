"""stage=extract: the target's hidden states at `layer_ids` for every sample, into `states/`.

    accelerate launch --config_file launch/cpu_2proc.yaml dflash/main.py stage=extract
    accelerate launch --config_file launch/gpu_n.yaml dflash/main.py stage=extract \
        model=qwen3_6_27b model.path=/ckpt/Qwen3.6-27B data=file data.path=/data/convs.parquet

Reads the target checkpoint (`model.path`; the embedded one is built first) and the prepared
data (prepared first when missing). Writes under `${run_dir}`:
  states/manifest.json, states/shards/*.safetensors   the published format (design.md §3)
  states/journal/*.jsonl                              shards written, per launch and rank
  progress/rank<r>.json, logs/rank<r>.log, wandb/     telemetry
  .sync/*.json                                        file barriers of this launch

Steps: validate and prepare (rank 0) -> plan: every rank computes the same length-sorted,
token-budget batches over the samples not yet stored and takes its token-balanced share ->
loop: forward with hooks, check, copy to host, hand to the background shard writer -> finalize:
each rank marks itself done; rank 0 checks the totals against the plan and marks the manifest
complete. Re-running the same run stores only the missing samples, whatever the world size.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dflash.config import Config
from dflash.data.batching import assign_to_ranks, plan_batches
from dflash.data.prepare import ensure_prepared, load_prepared
from dflash.runtime import Runtime
from dflash.store.consolidate import consolidate, stored_sample_ids
from dflash.store.layers import check_layer_ids, zlab_target_layer_ids
from dflash.store.manifest import check_compatible, new_manifest, read_manifest, write_manifest
from dflash.store.writer import ShardWriter
from dflash.target.capture import HiddenStateCapture, stored_bytes_per_token
from dflash.target.extraction import RowFetcher, prefetch_inputs, run_extraction
from dflash.target.compile import compile_decoder_layers, should_compile
from dflash.target.kernels import bind_fast_kernels
from dflash.target.load import base_model_of, ensure_target, target_info_of
from dflash.telemetry import (ProgressMeter, RankProgress, WandbRun, nvml_metrics, read_progress, steady_tokens_per_s,
                              summarize)

log = logging.getLogger(__name__)


def run(cfg: Config, rt: Runtime, wandb_run: WandbRun) -> None:
    states_dir = rt.run_dir / "states"

    # -- validate and prepare: rank 0 builds what is missing, the others wait ---------------
    def prepare() -> None:
        ensure_target(cfg.model)
        ensure_prepared(cfg.data, cfg.model, rt.device)
        expected = expected_manifest(cfg, states_dir)
        manifest = read_manifest(states_dir)
        if manifest is None:
            states_dir.mkdir(parents=True, exist_ok=True)
            manifest = expected
        check_compatible(manifest, expected, states_dir)
        where = consolidate(states_dir, manifest, verify_new=True)
        log.info("states dir holds %d samples in %d shards", len(where), len(manifest["shards"]))

    rt.main_first("prepared", prepare)
    manifest = read_manifest(states_dir)
    layer_ids = manifest["layer_ids"]
    stored = stored_sample_ids(states_dir, manifest["shards"])

    # -- plan: the same on every rank, no communication --------------------------------------
    dataset, _ = load_prepared(cfg.data.prepared_dir)
    ids, lengths, num_skipped, num_truncated = eligible_samples(dataset, cfg.extract.max_length,
                                                                cfg.extract.overlong)
    todo = ~np.isin(ids, np.fromiter(stored, dtype=np.int64, count=len(stored)))
    batches = plan_batches(ids[todo], lengths[todo], cfg.extract.token_budget, cfg.extract.max_batch_size)
    mine = assign_to_ranks(batches, rt.world_size)[rt.rank]
    fetch_rows = row_fetcher(dataset)
    planned_tokens = sum(b.num_real_tokens for b in mine)
    log.info("plan: %d samples (%d tokens) of %d to extract, %d already stored; %d batches for "
             "%d ranks, this rank %d batches, %d samples, %d tokens; %d overlong samples %s",
             int(todo.sum()), int(lengths[todo].sum()), len(ids), len(ids) - int(todo.sum()),
             len(batches), rt.world_size, len(mine), sum(len(b.sample_ids) for b in mine),
             planned_tokens, num_skipped + num_truncated,
             "skipped" if cfg.extract.overlong == "skip" else "truncated")
    store_dtype = getattr(torch, cfg.extract.dtype)
    bytes_per_token = stored_bytes_per_token(len(layer_ids), manifest["target"]["hidden_size"], store_dtype)
    log.info("layer ids %s, %d bytes per token stored", layer_ids, bytes_per_token)

    # -- loop ------------------------------------------------------------------------------
    kernels = bind_fast_kernels(rt.device)
    model = base_model_of(cfg.model, max(layer_ids) + 1, rt.device)
    compiled = should_compile(cfg.extract.compile, rt.device)
    if compiled:
        compile_decoder_layers(model.layers)
    capture = HiddenStateCapture(model, layer_ids, store_dtype, cfg.extract.writer_queue_batches + 2,
                                 max_batch_tokens=max((b.num_padded_tokens for b in mine), default=0))
    writer = ShardWriter(states_dir, rt.launch_id, rt.rank, cfg.extract.shard_max_bytes,
                         cfg.extract.writer_queue_batches, cfg.extract.writer_threads)
    progress_dir = rt.run_dir / "progress"
    meter = ProgressMeter(progress_dir, RankProgress(
        rank=rt.rank, launch_id=rt.launch_id, planned_samples=sum(len(b.sample_ids) for b in mine),
        planned_tokens=planned_tokens), cfg.extract.progress_interval_s)

    def log_progress() -> None:
        wandb_run.log({**summarize(read_progress(progress_dir, rt.launch_id, rt.world_size),
                                   rt.world_size), **nvml_metrics()})

    def on_batch(padded) -> None:
        recorded = meter.update(len(padded.sample_ids), padded.num_real_tokens, padded.num_padded_tokens,
                                writer.stats.num_bytes, writer.queue_depth,
                                writer.stats.compute_wait_s + capture.buffer_wait_s)
        if recorded and rt.is_main:
            log_progress()

    wandb_run.summary({"extract/fast_kernels": int(kernels.fast), "extract/compiled": int(compiled)})
    try:
        inputs = prefetch_inputs(fetch_rows, mine, cfg.extract.max_length, pin=rt.device.type == "cuda")
        stats, times = run_extraction(capture, writer, inputs, on_batch)
    finally:
        capture.remove()
    writer_wait_s = times.writer_wait_s
    meter.close(stats.num_bytes, writer_wait_s)
    log.info("rank %d stored %d samples, %d tokens, %.1f MB in %d shards; compute waited %.1fs on the writer; "
             "loop: %s; writer: %.1fs writing, %.1fs waiting for a flush thread", rt.rank, stats.num_samples,
             stats.num_tokens, stats.num_bytes / 1e6, stats.num_shards, writer_wait_s, times.summary(),
             stats.write_s, stats.flush_wait_s)

    # -- finalize: file barrier, totals check, manifest complete ----------------------
    if not rt.is_main:
        rt.mark("extracted", num_samples=stats.num_samples, num_tokens=stats.num_tokens)
        rt.wait_for_main("complete")
        return
    barrier_wait_s = rt.barrier("extracted", on_poll=log_progress,
                                num_samples=stats.num_samples, num_tokens=stats.num_tokens)
    log_progress()
    records = read_progress(progress_dir, rt.launch_id, rt.world_size)
    elapsed = max((r["elapsed_s"] for r in records), default=0.0)
    aggregate = sum(r["tokens_done"] for r in records) / elapsed if elapsed else 0.0
    steady = [steady_tokens_per_s(r) for r in records]
    steady_per_rank = [f"{rate:.0f}" if r["tokens_done"] > r.get("warmup_tokens", 0) else "n/a: one batch"
                       for rate, r in zip(steady, records)]
    log.info("extraction throughput: %.0f tokens/s over %d ranks (per rank: %s); steady state after each "
             "rank's first batch (compilation): %.0f tokens/s (per rank: %s)", aggregate, rt.world_size,
             ", ".join(f"{r['tokens_done'] / r['elapsed_s']:.0f}" for r in records if r["elapsed_s"]),
             sum(steady), ", ".join(steady_per_rank))
    where = consolidate(states_dir, manifest, verify_new=False)
    check_totals(where, ids, lengths, manifest)
    manifest["extraction"].update(num_skipped_overlong=num_skipped, num_truncated=num_truncated)
    manifest.update(complete=True, launch_id=rt.launch_id)
    write_manifest(states_dir, manifest)
    rt.mark("complete")
    wandb_run.summary({"extract/barrier_wait(s)": barrier_wait_s, "extract/complete": 1,
                       "extract/aggregate_throughput(tokens/s)": aggregate,
                       "extract/aggregate_steady_throughput(tokens/s)": sum(steady),
                       "extract/num_samples": manifest["num_samples"],
                       "extract/num_tokens": manifest["num_tokens"],
                       "extract/num_skipped_overlong": num_skipped,
                       "extract/num_truncated": num_truncated})
    log.info("states complete: %d samples, %d tokens, %d shards in %s (rank 0 waited %.1fs at "
             "the barrier)", manifest["num_samples"], manifest["num_tokens"],
             len(manifest["shards"]), states_dir, barrier_wait_s)


def row_fetcher(dataset) -> RowFetcher:
    """sample ids -> their (input_ids, loss_mask) lists, read from the prepared Arrow dataset."""
    row_of = {int(sample_id): row for row, sample_id in enumerate(dataset["sample_id"])}
    columns = dataset.select_columns(["input_ids", "loss_mask"])

    def fetch(sample_ids):
        rows = columns[[row_of[s] for s in sample_ids]]
        return rows["input_ids"], rows["loss_mask"]
    return fetch


def expected_manifest(cfg: Config, states_dir: Path) -> dict[str, Any]:
    """The manifest this run would write into a fresh states dir (identity fields filled)."""
    info = target_info_of(cfg.model)
    layer_ids = (list(cfg.extract.layer_ids) if cfg.extract.layer_ids is not None
                 else zlab_target_layer_ids(info.num_hidden_layers, cfg.extract.num_draft_layers))
    check_layer_ids(layer_ids, info.num_hidden_layers)
    _, prepared_meta = load_prepared(cfg.data.prepared_dir)
    return new_manifest(info.as_dict(), layer_ids, cfg.extract.dtype, prepared_meta["fingerprint"],
                        {"max_length": cfg.extract.max_length, "overlong": cfg.extract.overlong})


def eligible_samples(dataset, max_length: int, overlong: str) -> tuple[np.ndarray, np.ndarray, int, int]:
    """(sample ids [N], lengths [N] after truncation, number skipped, number truncated) of the
    samples to extract under the `extract.overlong` policy."""
    ids = np.asarray(dataset["sample_id"], dtype=np.int64)
    lengths = np.asarray(dataset["length"], dtype=np.int64)
    over = lengths > max_length
    if overlong == "skip":
        return ids[~over], lengths[~over], int(over.sum()), 0
    return ids, np.minimum(lengths, max_length), 0, int(over.sum())


def check_totals(where: dict[int, str], ids: np.ndarray, lengths: np.ndarray, manifest: dict[str, Any]) -> None:
    """Every eligible sample stored exactly once, nothing else, with the planned token count."""
    missing = set(ids.tolist()) - where.keys()
    extra = where.keys() - set(ids.tolist())
    if missing or extra or manifest["num_tokens"] != int(lengths.sum()):
        raise RuntimeError(
            f"totals do not match the plan: {len(missing)} samples missing (e.g. {sorted(missing)[:5]}), "
            f"{len(extra)} unexpected (e.g. {sorted(extra)[:5]}), {manifest['num_tokens']} tokens stored "
            f"vs {int(lengths.sum())} planned; the manifest stays incomplete. Re-run to extract the rest")
