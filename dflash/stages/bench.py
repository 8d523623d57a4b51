"""stage=bench: extraction throughput of the predecessor-style baseline and of dflash's own
path, on the same target, lengths and token budget, in one process; prints a table.

    python dflash/main.py stage=bench bench=h200 model=qwen3_6_27b model.init=random \
        extract.layer_ids=[1,16,31,46,61] extract.token_budget=12000      # one H200
    python dflash/main.py stage=bench bench=smoke                          # CPU smoke, tiny target

Every batch shape runs once untimed before the variants (Triton and torch.compile compile per
shape class). Variants: `forward_only` = the ceiling: the truncated forward with its hooks,
inputs already on the device, nothing copied out. `baseline` = what the predecessor's final
script did: length-sorted padded batches with their attention mask, hooks on the layers, the
full causal LM (every layer and the lm_head's logits), a synchronous `.cpu()` of the stacked
states per batch, nothing written, eager, with the kernels transformers picks by itself (fla's
delta rule when fla is installed, the torch conv). `padded` = dflash's extraction path, exactly
what stage=extract runs (prefetch thread, truncated base model, fla kernels on GPU, unmasked
right-padded batches, compiled decoder layers per `extract.compile`, side-stream copies into
pinned buffers, the shard writer writing to `${run_dir}/bench/`). `padded_eager` = the same
without torch.compile. `padded_nowrite` = the same minus the disk (batches copied, checked,
dropped). `padded_fp8` = the same storing float8_e4m3fn. Rank 0 writes `${run_dir}/bench.json`
and logs to W&B; every rank logs its own table. With `bench.new_shape_batches`, batches of batch
sizes not met before then run one at a time: the extra seconds of a shape met for the first time
(`new_shape_extra_s`), which the untimed pass hides from the table and stage=extract pays.

MFU = 2 x (parameters of decoder layers 0..max(layer_ids)) x real tokens/s over the rate of a
bf16 matrix product measured in the same run (float32 on a CPU); padded tokens do not count.
`MFU w/o drain` leaves out the `drain s` after the last batch was handed over, while the writer
finishes the last shards: a one-off cost per run that a benchmark of a few batches magnifies
(a 1 GB shard takes ~2 s; a real run is hours long).
"""

from __future__ import annotations

import copy
import logging
import queue
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from dflash.atomic import write_json_atomic
from dflash.config import Config
from dflash.data.batching import plan_batches
from dflash.data.synthetic import lognormal_lengths
from dflash.runtime import Runtime
from dflash.store import StateReader
from dflash.store.consolidate import consolidate
from dflash.store.layers import check_layer_ids, zlab_target_layer_ids
from dflash.store.manifest import new_manifest, write_manifest
from dflash.store.writer import ShardWriter, WriterStats
from dflash.target.capture import HiddenStateCapture, pad_right
from dflash.target.compile import compile_decoder_layers, restore_eager, should_compile
from dflash.target.extraction import prefetch_inputs, run_extraction
from dflash.target.kernels import bind_fast_kernels, bind_transformers_kernels
from dflash.target.load import causal_lm_of, ensure_target
from dflash.telemetry import WandbRun, nvml_metrics

log = logging.getLogger(__name__)


@dataclass
class VariantResult:
    name: str
    seconds: float
    real_tokens: int
    padded_tokens: int
    samples: int
    bytes_written: int
    peak_memory_gib: float
    gpu_busy: float  # mean NVML utilization over the run, 0..1 (nan without NVML)
    writer_wait_s: float  # seconds compute blocked on the writer (full queue or no free host buffer)
    drain_s: float  # seconds from the last batch's hand-over until every shard was written

    def row(self, flops_per_token: float, matmul_flops: float, baseline: "VariantResult | None") -> dict:
        tokens_per_s = self.real_tokens / self.seconds
        steady_tokens_per_s = self.real_tokens / (self.seconds - self.drain_s)
        return {"variant": self.name, "tokens/s": tokens_per_s, "samples/s": self.samples / self.seconds,
                "MFU": tokens_per_s * flops_per_token / matmul_flops,
                "MFU w/o drain": steady_tokens_per_s * flops_per_token / matmul_flops, "drain s": self.drain_s,
                "GPU busy": self.gpu_busy,
                "write MB/s": self.bytes_written / self.seconds / 1e6,
                "bytes/token": self.bytes_written / self.real_tokens if self.bytes_written else 0.0,
                "peak GiB": self.peak_memory_gib, "padding": 1 - self.real_tokens / self.padded_tokens,
                "writer wait": self.writer_wait_s / self.seconds,
                "x baseline": tokens_per_s / (baseline.real_tokens / baseline.seconds) if baseline else float("nan")}


def run(cfg: Config, rt: Runtime, wandb_run: WandbRun) -> None:
    device = rt.device
    kernels = bind_fast_kernels(device)
    rt.main_first("target", lambda: ensure_target(cfg.model))  # rank 0 builds an embedded target
    lm = causal_lm_of(cfg.model, device)  # the baseline needs the lm_head
    num_layers_total = lm.config.num_hidden_layers
    layer_ids = (list(cfg.extract.layer_ids) if cfg.extract.layer_ids is not None
                 else zlab_target_layer_ids(num_layers_total, cfg.extract.num_draft_layers))
    check_layer_ids(layer_ids, num_layers_total)
    base = truncated_base(lm.model, max(layer_ids) + 1)
    flops_per_token = 2 * sum(p.numel() for p in base.layers.parameters())
    matmul_flops = matmul_rate(device, cfg.bench.matmul_size)

    b = cfg.bench
    rng = np.random.default_rng(b.seed)
    lengths = lognormal_lengths(rng, b.num_samples, b.length_mean, b.length_sigma, b.max_length, b.min_length)
    plan = plan_batches(np.arange(len(lengths)), lengths, cfg.extract.token_budget, cfg.extract.max_batch_size)
    batches = timed_batches(plan, b.num_batches)
    fresh = new_shape_batches(plan, batches, b.new_shape_batches)
    vocab = lm.config.vocab_size
    tokens = {s: rng.integers(0, vocab, size=int(lengths[s])).tolist()
              for batch in batches + fresh for s in batch.sample_ids}
    num_tokens = sum(batch.num_real_tokens for batch in batches)
    log.info("bench: %d samples (mean %.0f tokens, max %d) planned into %d batches under a %d-token budget "
             "(padding %.1f%%); %d of them run, %d samples, %d tokens; layers %s of %d; %.1f GFLOP/token; "
             "matmul %.1f TFLOP/s; kernels %s", len(lengths), lengths.mean(), lengths.max(), len(plan),
             cfg.extract.token_budget, 100 * padding_fraction(plan), len(batches), len(tokens), num_tokens,
             layer_ids, num_layers_total, flops_per_token / 1e9, matmul_flops / 1e12, kernels)

    def fetch_rows(sample_ids):
        return [tokens[s] for s in sample_ids], [[1] * len(tokens[s]) for s in sample_ids]

    results: list[VariantResult] = []
    warm, timed = batches[: b.warmup_batches], batches
    out_root = rt.run_dir / "bench" / f"rank{rt.rank}"  # every rank benchmarks its own device
    compiled = should_compile(cfg.extract.compile, device)
    # Triton and torch.compile compile per new shape: one untimed pass over every batch shape
    # first, so that no variant pays for compilation (a long run meets each shape early and
    # then reuses it).
    if compiled:
        compile_decoder_layers(base.layers)
    start = time.perf_counter()
    forward_only(base, layer_ids, fetch_rows, batches, device)
    first_pass_s = time.perf_counter() - start
    log.info("untimed pass over every batch shape (compiles): %.1f s", first_pass_s)
    for name in b.variants:
        shutil.rmtree(out_root / name, ignore_errors=True)
        bind_fast_kernels(device)
        compile_variant = compiled and name not in ("baseline", "padded_eager")
        if compile_variant:
            compile_decoder_layers(base.layers)
        else:
            restore_eager(base.layers)  # the layers are shared with `lm`
        if name == "baseline":
            bind_transformers_kernels()  # as the predecessor ran: transformers' own kernel choice
            run_variant = lambda plan: baseline(lm, layer_ids, fetch_rows, plan, device)  # noqa: E731
        elif name == "forward_only":
            run_variant = lambda plan: forward_only(base, layer_ids, fetch_rows, plan, device)  # noqa: E731
        else:
            dtype = torch.float8_e4m3fn if name == "padded_fp8" else torch.bfloat16
            run_variant = lambda plan, dtype=dtype, name=name: dflash_path(  # noqa: E731
                cfg, base, layer_ids, dtype, fetch_rows, plan, device, out_root / name,
                discard=name == "padded_nowrite")
        log.info("%s: %s decoder layers", name, "compiled" if compile_variant else "eager")
        run_variant(warm)
        shutil.rmtree(out_root / name, ignore_errors=True)
        result = measure(name, lambda: run_variant(timed), device)
        results.append(result)
        log.info("%s: %.1f s, %d tokens", name, result.seconds, result.real_tokens)
    bind_fast_kernels(device)
    new_shape_s = None
    ceiling = next((r for r in results if r.name == "forward_only"), None)
    if fresh and ceiling is not None:
        if compiled:
            compile_decoder_layers(base.layers)
        new_shape_s = new_shape_cost(lambda plan: forward_only(base, layer_ids, fetch_rows, plan, device), fresh,
                                     ceiling.real_tokens / ceiling.seconds, device)
        log.info("a batch of a batch size met for the first time: %.2f s more than at the warm rate (mean of %d)",
                 new_shape_s, len(fresh))
    restore_eager(base.layers)

    base_result = next((r for r in results if r.name == "baseline"), None)
    rows = [r.row(flops_per_token, matmul_flops, base_result) for r in results]
    fp8_error = fp8_round_trip_error(out_root) if {"padded", "padded_fp8"} <= set(b.variants) else None
    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "model": cfg.model.name, "layer_ids": layer_ids, "token_budget": cfg.extract.token_budget,
              "num_samples": len(tokens), "num_tokens": num_tokens, "plan_num_samples": len(lengths),
              "plan_num_batches": len(plan), "plan_padding": padding_fraction(plan), "flops_per_token": flops_per_token,
              "matmul_flops": matmul_flops, "fast_kernels": kernels.fast, "compiled": compiled,
              "first_pass_s": first_pass_s, "new_shape_extra_s": new_shape_s,
              "fp8_relative_error": fp8_error,
              "rows": rows}
    if rt.is_main:
        write_json_atomic(rt.run_dir / "bench.json", report)
    log.info("bench results (%s, %s, budget %d):\n%s%s", report["device"], cfg.model.name,
             cfg.extract.token_budget, format_table(rows),
             f"\nfp8 round trip: relative RMS error {fp8_error:.4f}" if fp8_error is not None else "")
    wandb_run.summary({f"bench/{row['variant']}/{key}": value for row in rows for key, value in row.items()
                       if key != "variant"})
    shutil.rmtree(out_root, ignore_errors=True)


def timed_batches(plan: list, num_batches: int) -> list:
    """`num_batches` batches of `plan` evenly spaced from its first (longest) to its last
    (shortest), in plan order; all of `plan` when `num_batches` is 0 or covers it."""
    if not 0 < num_batches < len(plan):
        return list(plan)
    return [plan[i] for i in np.unique(np.linspace(0, len(plan) - 1, num_batches).round().astype(int))]


def new_shape_batches(plan: list, timed: list, count: int) -> list:
    """Up to `count` batches of `plan`, evenly spaced, each of a batch size (number of samples)
    that no batch of `timed` has and no other chosen batch has."""
    seen = {len(batch.sample_ids) for batch in timed}
    candidates = []
    for batch in plan:
        if len(batch.sample_ids) not in seen:
            seen.add(len(batch.sample_ids))
            candidates.append(batch)
    if count <= 0 or not candidates:
        return []
    picks = np.unique(np.linspace(0, len(candidates) - 1, min(count, len(candidates))).round().astype(int))
    return [candidates[i] for i in picks]


def new_shape_cost(run_forward, fresh: list, warm_tokens_per_s: float, device: torch.device) -> float:
    """Mean seconds a batch of `fresh` (shapes not met before) takes beyond its real tokens at
    `warm_tokens_per_s`: what compilation and autotuning for a new shape cost. stage=extract pays
    it once per batch shape and machine (the kernel caches are on disk)."""
    extra = []
    for batch in fresh:
        sync(device)
        start = time.perf_counter()
        run_forward([batch])
        sync(device)
        extra.append(time.perf_counter() - start - batch.num_real_tokens / warm_tokens_per_s)
    return float(np.mean(extra))


def padding_fraction(plan: list) -> float:
    return 1 - sum(b.num_real_tokens for b in plan) / sum(b.num_padded_tokens for b in plan)


def truncated_base(base: torch.nn.Module, num_layers: int) -> torch.nn.Module:
    """A view of `base` (sharing its weights) that runs only layers 0..num_layers-1."""
    view = copy.copy(base)
    view._modules = dict(base._modules)
    view.layers = torch.nn.ModuleList(list(base.layers)[:num_layers])
    view.config = copy.deepcopy(base.config)
    view.config.num_hidden_layers = num_layers
    view.config.layer_types = view.config.layer_types[:num_layers]
    return view


def matmul_rate(device: torch.device, size: int) -> float:
    """FLOP/s of a square matrix product on random data (bf16 on a GPU, float32 on a CPU):
    median of 10 after 3 warm-ups."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a, b = (torch.randn(size, size, device=device, dtype=dtype) for _ in range(2))
    times = []
    for i in range(13):
        sync(device)
        start = time.perf_counter()
        a @ b
        sync(device)
        if i >= 3:
            times.append(time.perf_counter() - start)
    return 2 * size**3 / float(np.median(times))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class UtilizationSampler:
    """Mean NVML utilization of this GPU while it runs (a thread sampling every 50 ms)."""

    def __init__(self, device: torch.device):
        self.index = (device.index or 0) if device.type == "cuda" else None
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            value = nvml_metrics().get(f"gpu/{self.index}/utilization(%)")
            if value is not None:
                self.samples.append(value / 100)

    def __enter__(self):
        if self.index is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    @property
    def mean(self) -> float:
        return float(np.mean(self.samples)) if self.samples else float("nan")


def measure(name: str, work, device: torch.device) -> VariantResult:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    sync(device)
    with UtilizationSampler(device) as util:
        start = time.perf_counter()
        counts = work()
        sync(device)
        seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    return VariantResult(name, seconds, counts["real"], counts["padded"], counts["samples"], counts["bytes"],
                         peak, util.mean, counts.get("writer_wait_s", 0.0), counts.get("drain_s", 0.0))


@torch.inference_mode()
def baseline(lm, layer_ids, fetch_rows, plan, device) -> dict:
    """The predecessor's final design: padded batches with their attention mask, hooks on the
    layers, the full causal LM called as its script called it (logits of every position, the
    model's default `use_cache=True` of the real checkpoint), a synchronous copy of the stacked
    states per batch."""
    captured: dict[int, torch.Tensor] = {}
    handles = [lm.model.layers[i].register_forward_hook(
        lambda module, args, out, i=i: captured.__setitem__(i, out)) for i in layer_ids]
    counts = {"real": 0, "padded": 0, "samples": 0, "bytes": 0}
    try:
        for batch in plan:
            ids, masks = fetch_rows(batch.sample_ids)
            padded = pad_right(list(batch.sample_ids), ids, masks)
            attention = padded.attention_mask_BS.to(device) if padded.attention_mask_BS is not None else None
            lm(input_ids=padded.input_ids_BS.to(device), attention_mask=attention, use_cache=True)
            torch.stack([captured[i] for i in layer_ids], dim=2).cpu()
            _count(counts, padded)
    finally:
        for handle in handles:
            handle.remove()
    return counts


@torch.inference_mode()
def forward_only(base, layer_ids, fetch_rows, plan, device) -> dict:
    """The ceiling: the truncated forward (unmasked, as the capture runs it) with hooks filling
    a device buffer, inputs already on the device, nothing copied out or written."""
    inputs = []
    for batch in plan:
        ids, masks = fetch_rows(batch.sample_ids)
        padded = pad_right(list(batch.sample_ids), ids, masks)
        inputs.append((padded, padded.input_ids_BS.to(device)))
    capture = HiddenStateCapture(base, layer_ids, torch.bfloat16)
    counts = {"real": 0, "padded": 0, "samples": 0, "bytes": 0}
    sync(device)
    try:
        for padded, input_ids in inputs:
            capture._buffer = torch.empty(*input_ids.shape, len(layer_ids), base.config.hidden_size,
                                          dtype=torch.bfloat16, device=device)
            base(input_ids=input_ids, use_cache=False)
            _count(counts, padded)
    finally:
        capture.remove()
    return counts


class DiscardWriter:
    """A writer that only waits for each batch's copy and check, then drops it: the extraction
    path without the disk."""

    def __init__(self):
        self._queue: "queue.Queue" = queue.Queue(maxsize=4)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        self.stats = WriterStats()

    def _run(self):
        while (batch := self._queue.get()) is not None:
            batch.wait()
            if batch.release is not None:
                batch.release()

    def put(self, batch) -> None:
        self._queue.put(batch)

    def close(self):
        self._queue.put(None)
        self._thread.join()
        return self.stats

    abort = close


def dflash_path(cfg, base, layer_ids, store_dtype, fetch_rows, plan, device, states_dir: Path,
                discard: bool = False) -> dict:
    """stage=extract's loop on `plan`, writing real shards to `states_dir` (or dropping them)."""
    states_dir.mkdir(parents=True, exist_ok=True)
    capture = HiddenStateCapture(base, layer_ids, store_dtype, cfg.extract.writer_queue_batches + 2,
                                 max_batch_tokens=max(batch.num_padded_tokens for batch in plan))
    writer = DiscardWriter() if discard else ShardWriter(
        states_dir, "bench", 0, cfg.extract.shard_max_bytes, cfg.extract.writer_queue_batches,
        cfg.extract.writer_threads)
    counts = {"real": 0, "padded": 0, "samples": 0}
    inputs = prefetch_inputs(fetch_rows, plan, cfg.extract.max_length, pin=device.type == "cuda")
    try:
        stats, times = run_extraction(capture, writer, inputs, lambda padded: _count(counts, padded))
    finally:
        capture.remove()
    log.info("%s loop: %s; writer: %d shards, %.1fs writing, %.1fs waiting for a flush thread", states_dir.name,
             times.summary(), stats.num_shards, stats.write_s, stats.flush_wait_s)
    if not discard:
        info = {"path": "bench", "num_hidden_layers": 0, "hidden_size": base.config.hidden_size,
                "vocab_size": base.config.vocab_size, "config_sha256": ""}
        manifest = new_manifest(info, layer_ids, str(store_dtype).removeprefix("torch."), "bench", {})
        consolidate(states_dir, manifest, verify_new=False)
        manifest["complete"] = True
        write_manifest(states_dir, manifest)
    return {**counts, "bytes": stats.num_bytes, "writer_wait_s": times.writer_wait_s, "drain_s": times.close_s}


def _count(counts: dict, padded) -> None:
    counts["real"] += padded.num_real_tokens
    counts["padded"] += padded.num_padded_tokens
    counts["samples"] += len(padded.sample_ids)


def fp8_round_trip_error(out_root: Path) -> float:
    """Relative RMS error of the fp8 states against the bf16 ones, over all samples."""
    bf16, fp8 = StateReader(out_root / "padded"), StateReader(out_root / "padded_fp8")
    num = den = 0.0
    for sample_id in bf16.sample_ids:
        a, b = fp8[sample_id].hidden_states.float(), bf16[sample_id].hidden_states.float()
        num += float((a - b).pow(2).sum())
        den += float(b.pow(2).sum())
    return (num / den) ** 0.5


def format_table(rows: list[dict]) -> str:
    keys = list(rows[0])
    fmt = {"tokens/s": "{:,.0f}", "samples/s": "{:.2f}", "MFU": "{:.1%}", "MFU w/o drain": "{:.1%}",
           "drain s": "{:.1f}", "GPU busy": "{:.0%}",
           "write MB/s": "{:.0f}", "bytes/token": "{:,.0f}", "peak GiB": "{:.1f}", "padding": "{:.1%}",
           "writer wait": "{:.0%}",
           "x baseline": "{:.2f}"}
    cells = [[row["variant"]] + [fmt[k].format(row[k]) for k in keys[1:]] for row in rows]
    widths = [max(len(str(x)) for x in column) for column in zip(keys, *cells)]
    line = lambda values: "| " + " | ".join(str(v).rjust(w) for v, w in zip(values, widths)) + " |"  # noqa: E731
    return "\n".join([line(keys), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, cells)])
