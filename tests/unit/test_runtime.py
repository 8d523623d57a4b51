"""File barriers: a timeout names the missing ranks; a failed rank stops the others at once."""

import threading

import pytest
import torch

from dflash.runtime import BarrierTimeout, PeerFailed, Runtime


def make_runtime(tmp_path, rank, world_size=3, launch_id="L1", timeout_s=0.5):
    (tmp_path / ".sync").mkdir(exist_ok=True)
    return Runtime(rank=rank, world_size=world_size, local_rank=rank, device=torch.device("cpu"),
                   run_dir=tmp_path, launch_id=launch_id, barrier_timeout_s=timeout_s, poll_s=0.01)


def test_barrier_timeout_names_the_missing_ranks(tmp_path):
    make_runtime(tmp_path, 1).mark("extracted")
    with pytest.raises(BarrierTimeout, match=r"ranks \[2\] of 3 never arrived within barrier.timeout_s=0.5s"):
        make_runtime(tmp_path, 0).barrier("extracted")


def test_markers_of_an_earlier_launch_do_not_count(tmp_path):
    for rank in (1, 2):
        make_runtime(tmp_path, rank, launch_id="old").mark("extracted")
    with pytest.raises(BarrierTimeout, match=r"ranks \[1, 2\]"):
        make_runtime(tmp_path, 0).barrier("extracted")


def test_barrier_passes_when_all_arrive(tmp_path):
    ranks = [make_runtime(tmp_path, r, timeout_s=30) for r in range(3)]
    threads = [threading.Thread(target=rt.barrier, args=("b",)) for rt in ranks[1:]]
    for t in threads:
        t.start()
    assert ranks[0].barrier("b") >= 0
    for t in threads:
        t.join(timeout=30)
        assert not t.is_alive()


def test_a_failed_rank_stops_the_waiting_ones(tmp_path):
    make_runtime(tmp_path, 0).mark_failed(RuntimeError("disk on fire"))
    with pytest.raises(PeerFailed, match="rank 0 failed .*disk on fire"):
        make_runtime(tmp_path, 1, timeout_s=30).wait_for_main("complete")
