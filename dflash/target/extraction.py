"""The extraction loop shared by stage=extract and stage=bench.

    inputs = prefetch_inputs(fetch_rows, batches, max_length, pin=on_gpu)   # a thread builds batches ahead
    stats = run_extraction(capture, writer, inputs, on_batch)               # forward -> host -> writer

Three things run at once on a GPU: a thread assembling (and pinning) the next batches, the
compute stream running the forward, and the writer thread waiting for each batch's side-stream
copy, checking it and packing shards. The loop itself never waits for the GPU; it blocks only
when the writer queue is full (disk slower than compute) or no batch is ready yet.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

from dflash.data.batching import Batch
from dflash.store.writer import ShardWriter, WriterStats
from dflash.target.capture import HiddenStateCapture, PaddedBatch, pad_right

RowFetcher = Callable[[tuple[int, ...]], tuple[list[list[int]], list[list[int]]]]
"""sample ids -> (input_ids, loss_mask) lists, in the given order."""

_DONE = object()


def prefetch_inputs(fetch_rows: RowFetcher, batches: Iterable[Batch], max_length: int, pin: bool,
                    ahead: int = 2) -> Iterator[PaddedBatch]:
    """The right-padded inputs of `batches` (truncated to `max_length`), built `ahead` batches
    in advance by a background thread, and pinned when `pin`. Errors re-raise here."""
    ready: queue.Queue = queue.Queue(maxsize=ahead)
    stop = threading.Event()

    def build() -> None:
        try:
            for batch in batches:
                if stop.is_set():
                    return
                input_ids, loss_masks = fetch_rows(batch.sample_ids)
                padded = pad_right(list(batch.sample_ids), [ids[:max_length] for ids in input_ids],
                                   [mask[:max_length] for mask in loss_masks])
                ready.put(padded.pin() if pin else padded)
            ready.put(_DONE)
        except BaseException as exc:  # handed to the consumer
            ready.put(exc)

    thread = threading.Thread(target=build, name="batch-prefetch", daemon=True)
    thread.start()
    try:
        while (item := ready.get()) is not _DONE:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        while thread.is_alive():  # unblock a producer waiting on a full queue
            try:
                ready.get_nowait()
            except queue.Empty:
                thread.join(timeout=0.1)


@dataclass
class LoopTimes:
    """Where the compute thread's time went, in seconds. On a GPU `launch_s` is the host time
    to enqueue the forwards and copies; when the GPU is not kept busy, the other fields say
    what the thread waited for."""

    input_wait_s: float = 0.0
    """Waiting for the prefetch thread's next batch."""
    launch_s: float = 0.0
    """Inside the capture call, less `buffer_wait_s`."""
    buffer_wait_s: float = 0.0
    """Blocked on a free pinned host buffer: the writer still held them all."""
    put_wait_s: float = 0.0
    """Blocked on the writer's full queue."""
    close_s: float = 0.0
    """Waiting for the writer to finish after the last batch."""

    @property
    def writer_wait_s(self) -> float:
        """Compute blocked on the writer, either way (full queue or no free host buffer)."""
        return self.put_wait_s + self.buffer_wait_s

    def summary(self) -> str:
        return ", ".join(f"{name.removesuffix('_s')} {value:.1f}s" for name, value in vars(self).items())


def run_extraction(capture: HiddenStateCapture, writer: ShardWriter, inputs: Iterable[PaddedBatch],
                   on_batch: Callable[[PaddedBatch], None] = lambda batch: None) -> tuple[WriterStats, LoopTimes]:
    """Capture every batch of `inputs` and hand it to `writer`; returns the writer's totals once
    every shard is written, and the loop's times. On any error the writer drops what it has not
    written."""
    times = LoopTimes()
    buffer_wait_before = capture.buffer_wait_s
    try:
        inputs = iter(inputs)
        while True:
            start = time.monotonic()
            padded = next(inputs, None)
            launched = time.monotonic()
            times.input_wait_s += launched - start
            if padded is None:
                break
            captured = capture(padded)
            times.launch_s += time.monotonic() - launched
            writer.put(captured)
            on_batch(padded)
        start = time.monotonic()
        stats = writer.close()
        times.close_s = time.monotonic() - start
    except BaseException:
        writer.abort()
        raise
    times.buffer_wait_s = capture.buffer_wait_s - buffer_wait_before
    times.launch_s -= times.buffer_wait_s
    times.put_wait_s = stats.compute_wait_s
    return stats, times
