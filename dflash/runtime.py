"""Process state (from accelerate), the run dir and file barriers between ranks.

Ranks synchronise through marker files under `${run_dir}/.sync`, never through a process-group
collective while they work: a rank can wait hours for another (rank 0 preparing data, a slow
extraction tail) without NCCL's 10-minute watchdog killing it, and a timeout names the ranks
that never arrived. Every marker carries the launch id, so markers of an earlier launch of the
same run are never mistaken for this one's. The one collective is the broadcast of that id at
start-up, when all ranks arrive within seconds.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from dflash.atomic import read_json, write_json_atomic

log = logging.getLogger(__name__)


class BarrierTimeout(RuntimeError):
    """Some ranks never reached a barrier; the message names them."""


class PeerFailed(RuntimeError):
    """Another rank of this launch failed while this one waited; the message names it."""


@dataclass
class Runtime:
    """Where this process stands. Built once per process by `init_runtime`."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    run_dir: Path
    launch_id: str
    """Random id of this launch, the same on every rank."""
    barrier_timeout_s: float
    poll_s: float

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def sync_dir(self) -> Path:
        return self.run_dir / ".sync"

    # -- markers ---------------------------------------------------------------------------
    def _marker(self, name: str, rank: int) -> Path:
        return self.sync_dir / f"{name}.rank{rank}.json"

    def mark(self, name: str, **payload) -> None:
        """Write this rank's marker `name` for this launch (atomic)."""
        write_json_atomic(self._marker(name, self.rank), {"launch_id": self.launch_id, **payload})

    def _has_marker(self, name: str, rank: int) -> bool:
        path = self._marker(name, rank)
        try:
            return read_json(path).get("launch_id") == self.launch_id
        except (FileNotFoundError, ValueError):
            return False

    def mark_failed(self, error: BaseException) -> None:
        """Tell the other ranks of this launch that this one failed (best effort)."""
        try:
            self.mark("failed", error=f"{type(error).__name__}: {error}")
        except OSError:
            pass

    def _raise_if_peer_failed(self) -> None:
        for rank in range(self.world_size):
            if rank != self.rank and self._has_marker("failed", rank):
                error = read_json(self._marker("failed", rank)).get("error", "?")
                raise PeerFailed(f"rank {rank} failed ({error}); rank {self.rank} stops too")

    # -- waiting ---------------------------------------------------------------------------
    def wait_until(self, what: str, missing: Callable[[], list[int]],
                   on_poll: Callable[[], None] | None = None) -> float:
        """Poll until `missing()` (the ranks not yet arrived) is empty; returns the seconds waited.
        Raises BarrierTimeout after `barrier.timeout_s`, naming the missing ranks, or PeerFailed
        as soon as another rank of this launch has failed. `on_poll` runs at every check (rank 0
        keeps logging the others' progress while it waits)."""
        start = time.monotonic()
        while True:
            absent = missing()
            if not absent:
                return time.monotonic() - start
            self._raise_if_peer_failed()
            if on_poll is not None:
                on_poll()
            waited = time.monotonic() - start
            if waited > self.barrier_timeout_s:
                raise BarrierTimeout(
                    f"{what}: ranks {absent} of {self.world_size} never arrived within "
                    f"barrier.timeout_s={self.barrier_timeout_s:g}s (markers in {self.sync_dir}); "
                    "check those ranks' logs in the run dir's logs/")
            time.sleep(self.poll_s)

    def barrier(self, name: str, on_poll: Callable[[], None] | None = None, **payload) -> float:
        """All ranks: mark `name` (with `payload`), then wait for every rank's marker. Returns
        the seconds waited."""
        self.mark(name, **payload)
        return self.wait_until(
            f"barrier `{name}`",
            lambda: [r for r in range(self.world_size) if not self._has_marker(name, r)], on_poll)

    def main_first(self, name: str, work: Callable[[], None]) -> None:
        """Rank 0 runs `work` and marks `name`; the other ranks wait for that mark."""
        if self.is_main:
            work()
            self.mark(name)
        else:
            self.wait_for_main(name)

    def wait_for_main(self, name: str) -> float:
        """Ranks other than 0: wait until rank 0 has marked `name` in this launch."""
        return self.wait_until(f"waiting for rank 0 to finish `{name}`",
                               lambda: [] if self._has_marker(name, 0) else [0])


def _broadcast_launch_id(world_size: int) -> str:
    launch_id = [uuid.uuid4().hex[:12]]
    if world_size > 1:
        from accelerate.utils import broadcast_object_list

        broadcast_object_list(launch_id, from_process=0)
    return launch_id[0]


def close_runtime() -> None:
    """End of a process that succeeded: destroy the process group. Without it, gloo's worker
    threads can abort the interpreter at exit ("terminate called without an active exception",
    SIGABRT), turning a finished run into a failed launch. Not called after a failure: a peer may
    still be inside a collective (torchtitan does the same)."""
    if torch.distributed.is_initialized():  # not after `--cfg job` or a config error
        from accelerate import PartialState

        PartialState().destroy_process_group()


def init_runtime(run_dir: str, device: str, barrier_timeout_s: float, poll_s: float) -> Runtime:
    """Read rank and world from accelerate's process state (set up by `accelerate launch` or
    torchrun; a plain `python` is rank 0 of 1), pick the device and create the run dir.
    `device`: `auto` | `cpu` | `cuda`. Called once by every rank."""
    from accelerate import PartialState

    # Without CUDA, PartialState(cpu=False) under torchrun would leave every rank thinking it is
    # alone; cpu=True makes it a gloo group of all ranks.
    state = PartialState(cpu=device == "cpu" or not torch.cuda.is_available())
    if device == "cuda" and state.device.type != "cuda":
        raise RuntimeError("device=cuda but this rank has no CUDA device; use device=auto")
    run_path = Path(run_dir)
    try:
        (run_path / ".sync").mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OSError(exc.errno, f"cannot create the run dir {run_path} (config keys output_root, "
                                 f"run_name): {exc.strerror or exc}") from exc
    runtime = Runtime(
        rank=state.process_index, world_size=state.num_processes,
        local_rank=state.local_process_index, device=torch.device(state.device),
        run_dir=run_path, launch_id=_broadcast_launch_id(state.num_processes),
        barrier_timeout_s=barrier_timeout_s, poll_s=poll_s)
    log.info("rank %d of %d on %s, run dir %s, launch %s", runtime.rank, runtime.world_size,
             runtime.device, run_path, runtime.launch_id)
    return runtime
