"""Background shard writer: compute hands over whole batches; a thread packs them into shards
and `writer_threads` flush threads write, checksum and journal the shards in parallel.

The queue between them is bounded (`extract.writer_queue_batches`): when the disk is slower than
the GPU, `put` blocks and that wait is measured (`compute_wait_s`), so the telemetry says which
side waits. An error in the writer thread (full disk, unwritable dir) is re-raised in the
compute thread at the next `put` or at `close`, and the shard being written is never journaled.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from dflash.atomic import write_atomic
from dflash.store.shards import append_journal, journal_path, shard_name, write_safetensors

log = logging.getLogger(__name__)


class BadHiddenStates(RuntimeError):
    """A captured row is non-finite or all zero; the message names the sample, token and layer."""


@dataclass
class CapturedBatch:
    """One batch of captured states on the host, right-padded.

    hidden_BSLH: [B, S, n_layers, H] in the store dtype (bfloat16, or float8_e4m3fn with
    scales_BSL [B, S, n_layers] float32: value = hidden * scale); rows past a sample's length
    are padding. input_ids_BS [B, S] int; loss_mask_BS [B, S] uint8; lengths, sample_ids [B].
    Until `wait` returns, the host tensors may still be filling (asynchronous copy).
    """

    hidden_BSLH: torch.Tensor
    scales_BSL: torch.Tensor | None
    input_ids_BS: torch.Tensor
    loss_mask_BS: torch.Tensor
    lengths: list[int]
    sample_ids: list[int]
    layer_ids: list[int]
    num_bad_rows: torch.Tensor | None = None
    """[1] int64 on the host: rows of real tokens found non-finite or all zero on the device."""
    ready: "torch.cuda.Event | None" = None
    release: Callable[[], None] | None = None
    """Hands the pinned host buffer back once the rows are copied out."""

    def wait(self) -> None:
        """Block until the host tensors are filled; raise BadHiddenStates on a bad row."""
        if self.ready is not None:
            self.ready.synchronize()
        if self.num_bad_rows is not None and int(self.num_bad_rows[0]) > 0:
            self._raise_bad_row()

    def _raise_bad_row(self) -> None:
        hidden = self.hidden_BSLH.float()
        if self.scales_BSL is not None:
            hidden = hidden * self.scales_BSL[..., None]
        for b, (length, sample_id) in enumerate(zip(self.lengths, self.sample_ids)):
            rows = hidden[b, :length]
            nonfinite_SL = ~torch.isfinite(rows).all(-1)
            if self.scales_BSL is not None:
                nonfinite_SL |= ~torch.isfinite(self.scales_BSL[b, :length])
            bad_SL = nonfinite_SL | (rows == 0).all(-1)
            if bad_SL.any():
                s, k = (int(i) for i in bad_SL.nonzero()[0])
                what = "non-finite" if nonfinite_SL[s, k] else "all-zero"
                raise BadHiddenStates(
                    f"sample id {sample_id}: {what} hidden state at token {s} of layer id {self.layer_ids[k]} "
                    f"({int(self.num_bad_rows[0])} bad rows in its batch); nothing of this batch was stored")
        raise BadHiddenStates(f"{int(self.num_bad_rows[0])} bad rows in the batch of sample ids {self.sample_ids}")


@dataclass
class WriterStats:
    """Counters of one writer, read by the telemetry (approximate while running)."""

    num_samples: int = 0
    num_tokens: int = 0
    num_bytes: int = 0
    num_shards: int = 0
    compute_wait_s: float = 0.0
    """Seconds `put` blocked on a full queue: the disk is the bottleneck."""
    write_s: float = 0.0
    """Seconds spent serialising and writing shards (summed over the flush threads)."""
    flush_wait_s: float = 0.0
    """Seconds the packing thread waited for a free flush thread (the disk the bottleneck)."""
    shards: list[str] = field(default_factory=list)


class ShardWriter:
    """Writes a rank's samples into shards under `states_dir/shards/`. Used by one rank's
    compute thread: `put` batches, then `close` (flushes the last shard, joins the thread)."""

    def __init__(self, states_dir: Path, launch_id: str, rank: int, shard_max_bytes: int,
                 queue_batches: int, writer_threads: int = 2):
        self.states_dir = Path(states_dir)
        (self.states_dir / "shards").mkdir(parents=True, exist_ok=True)
        self.journal = journal_path(self.states_dir, launch_id, rank)
        self.journal.parent.mkdir(parents=True, exist_ok=True)
        self.launch_id, self.rank, self.shard_max_bytes = launch_id, rank, shard_max_bytes
        self.stats = WriterStats()
        self._queue: queue.Queue[CapturedBatch | None] = queue.Queue(maxsize=queue_batches)
        self._error: BaseException | None = None
        self._abort = False
        self._pending: list[tuple] = []  # (sample id, hidden [T,L,H], ids [T], mask [T], scales [T,L] | None)
        self._pending_bytes = 0
        self._num_flushed = 0
        self._lock = threading.Lock()
        self._flushers = ThreadPoolExecutor(writer_threads, thread_name_prefix=f"shard-flush-r{rank}")
        self._slots = threading.Semaphore(writer_threads)
        self._futures: list = []
        self._thread = threading.Thread(target=self._run, name=f"shard-writer-r{rank}", daemon=True)
        self._thread.start()

    @property
    def queue_depth(self) -> int:
        return self._queue.qsize()

    def put(self, batch: CapturedBatch) -> None:
        """Queue a batch; blocks while the queue is full. Re-raises a writer error."""
        self._raise_if_failed()
        start = time.monotonic()
        while True:
            try:
                self._queue.put(batch, timeout=0.5)
                break
            except queue.Full:
                self._raise_if_failed()
        self.stats.compute_wait_s += time.monotonic() - start

    def close(self) -> WriterStats:
        """Write the last shard and stop the thread. Re-raises a writer error."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
        self._raise_if_failed()
        return self.stats

    def abort(self) -> None:
        """Stop without writing the pending samples (after an error elsewhere)."""
        self._abort = True
        if self._thread.is_alive():
            try:
                self._queue.put_nowait(None)
            except queue.Full:
                pass

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"rank {self.rank}: the shard writer failed: {self._error}") from self._error

    def _run(self) -> None:
        try:
            while (batch := self._queue.get()) is not None:
                if not self._abort:
                    self._add(batch)
            if self._pending and not self._abort:
                self._flush()
            self._flushers.shutdown(wait=True)
            for future in self._futures:
                future.result()
        except BaseException as exc:  # handed to the compute thread
            self._flushers.shutdown(wait=True, cancel_futures=True)
            self._error = exc
            # Drain so that a blocked `put` or `close` returns.
            while True:
                try:
                    self._queue.get_nowait()
                except queue.Empty:
                    break

    def _add(self, batch: CapturedBatch) -> None:
        batch.wait()  # the device-to-host copy is done, and no row is bad
        reused = batch.release is not None  # rows must leave the pooled host buffer
        for b, (length, sample_id) in enumerate(zip(batch.lengths, batch.sample_ids)):
            hidden = batch.hidden_BSLH[b, :length]
            scales = batch.scales_BSL[b, :length] if batch.scales_BSL is not None else None
            if reused:
                hidden, scales = hidden.clone(), scales.clone() if scales is not None else None
            self._pending.append((sample_id, hidden, batch.input_ids_BS[b, :length],
                                  batch.loss_mask_BS[b, :length], scales))
            self._pending_bytes += hidden.numel() * hidden.element_size()
            if self._pending_bytes >= self.shard_max_bytes:
                self._flush()
        if reused:
            batch.release()

    def _flush(self) -> None:
        """Hand the pending samples to a flush thread (blocks while `writer_threads` shards are
        already being written: the disk is the bottleneck then)."""
        samples, self._pending, self._pending_bytes = self._pending, [], 0
        rel = shard_name(self.launch_id, self.rank, self._num_flushed)
        self._num_flushed += 1
        start = time.monotonic()
        self._slots.acquire()
        self.stats.flush_wait_s += time.monotonic() - start
        future = self._flushers.submit(self._write_shard, samples, rel)
        future.add_done_callback(lambda _: self._slots.release())
        self._futures.append(future)
        for done in [f for f in self._futures if f.done()]:
            self._futures.remove(done)
            done.result()  # re-raise a flush error here

    def _write_shard(self, samples: list[tuple], rel: str) -> None:
        """Pack, write (temporary name, fsync, rename), checksum and journal one shard."""
        start = time.monotonic()
        lengths = torch.tensor([len(s[2]) for s in samples], dtype=torch.int64)
        offsets = torch.zeros(len(samples) + 1, dtype=torch.int64)
        torch.cumsum(lengths, 0, out=offsets[1:])
        tensors = {
            "hidden_states": torch.cat([s[1] for s in samples]),
            "input_ids": torch.cat([s[2] for s in samples]).to(torch.int32),
            "loss_mask": torch.cat([s[3] for s in samples]).to(torch.uint8),
            "offsets": offsets,
            "sample_ids": torch.tensor([s[0] for s in samples], dtype=torch.int64),
        }
        if samples[0][4] is not None:  # fp8: value = hidden_states * hidden_scales
            tensors["hidden_scales"] = torch.cat([s[4] for s in samples])
        path = self.states_dir / rel
        checksum = write_atomic(path, lambda tmp: write_safetensors(
            tmp, tensors, {"format": "pt", "dflash_format_version": "1"}))
        info = {"sha256": checksum, "num_samples": len(samples), "num_tokens": int(offsets[-1]),
                "num_bytes": path.stat().st_size}
        with self._lock:
            append_journal(self.journal, rel, info)
            self.stats.num_samples += info["num_samples"]
            self.stats.num_tokens += info["num_tokens"]
            self.stats.num_bytes += info["num_bytes"]
            self.stats.num_shards += 1
            self.stats.shards.append(rel)
            self.stats.write_s += time.monotonic() - start
        log.debug("wrote %s: %d samples, %d tokens, %d bytes", rel, info["num_samples"], info["num_tokens"],
                  info["num_bytes"])
