"""Multi-process runs through `accelerate launch`, as a user starts them: 2 CPU ranks, resume
after kill -9 with another world size, a full disk, W&B offline metrics."""

import os
import resource
import signal
import subprocess
import time
from pathlib import Path

import datasets
import pytest
import torch

from conftest import launch, main_command, small_overrides
from dflash.store import StateReader
from dflash.store.manifest import read_manifest
from dflash.store.shards import read_shard_index
from wandb_records import read_history

pytestmark = pytest.mark.slow

# Small batches and shards, so that a run writes many shards and can be killed between them.
MANY_SHARDS = ["extract.token_budget=128", "extract.shard_max_bytes=30000"]


@pytest.fixture(scope="module")
def two_rank_run(prepared_root):
    result = launch(prepared_root, "two-ranks", 2, ["wandb.mode=offline", *MANY_SHARDS])
    assert result.returncode == 0, result.stderr[-5000:]
    return Path(prepared_root) / "two-ranks"


def test_two_ranks_complete_every_sample_once(two_rank_run, prepared_root):
    manifest = read_manifest(two_rank_run / "states")
    assert manifest["complete"]
    ranks = {name.split("-")[1] for name in manifest["shards"]}
    assert ranks == {"r0000", "r0001"}, manifest["shards"]
    reader = StateReader(two_rank_run / "states")
    reader.verify()
    prepared = datasets.load_from_disk(f"{prepared_root}/prepared")
    assert reader.sample_ids == sorted(prepared["sample_id"])  # each exactly once (reader index)
    stored = [s for rel in manifest["shards"]
              for s in read_shard_index(two_rank_run / "states" / rel)[0].tolist()]
    assert len(stored) == len(set(stored)) == len(prepared)
    assert (two_rank_run / "logs" / "rank0.log").exists() and (two_rank_run / "logs" / "rank1.log").exists()


def test_wandb_offline_run_records_throughput(two_rank_run):
    (run_dir,) = (two_rank_run / "wandb").glob("offline-run-*")
    rows, summary = read_history(run_dir)
    logged = {key for row in rows for key in row}
    for key in ("extract/throughput(samples/s)", "extract/throughput(tokens/s)",
                "extract/rank0/throughput(tokens/s)", "extract/rank1/throughput(tokens/s)",
                "extract/padding(fraction)", "extract/write(bytes/s)",
                "extract/writer_queue_depth(batches)", "extract/eta(s)", "extract/tokens_done",
                "extract/steady_throughput(tokens/s)", "extract/rank1/steady_throughput(tokens/s)"):
        assert key in logged, key
    final = max((row for row in rows if "extract/samples_done" in row), key=lambda row: row["extract/samples_done"])
    assert final["extract/samples_done"] == 48 and final["extract/throughput(tokens/s)"] > 0
    assert summary["extract/complete"] == 1 and "extract/barrier_wait(s)" in summary
    assert summary["extract/aggregate_steady_throughput(tokens/s)"] >= 0


def test_kill_9_then_resume_with_another_world_size(two_rank_run, prepared_root):
    run_name = "killed"
    states = Path(prepared_root) / run_name / "states"
    command = main_command(1) + small_overrides(prepared_root, run_name) + MANY_SHARDS
    proc = subprocess.Popen(command, cwd=prepared_root, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while not any(p.stat().st_size for p in states.glob("journal/*.jsonl")):
        assert proc.poll() is None, "the run ended before it could be killed"
        assert time.monotonic() < deadline
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not read_manifest(states)["complete"]
    first_launch_shards = {p.name for p in (states / "shards").glob("*.safetensors")}
    assert first_launch_shards

    result = launch(prepared_root, run_name, 2, MANY_SHARDS)
    assert result.returncode == 0, result.stderr[-5000:]
    manifest = read_manifest(states)
    assert manifest["complete"]
    # What the killed launch stored was kept, not extracted again.
    kept = {rel.split("/")[1] for rel in manifest["shards"]} & first_launch_shards
    assert kept and len({name.split("-")[0] for name in manifest["shards"]}) == 2
    assert "already stored" in result.stderr

    resumed, reference = StateReader(states), StateReader(two_rank_run / "states")
    assert resumed.sample_ids == reference.sample_ids
    for sample_id in reference.sample_ids:
        a, b = resumed[sample_id], reference[sample_id]
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.loss_mask, b.loss_mask)
        # Batches differ between the runs; float32 results of different batch shapes may differ
        # in the last bits, so the stored bf16 may differ by one bf16 ulp at most.
        diff = (a.hidden_states.float() - b.hidden_states.float()).abs()
        ulp = torch.finfo(torch.bfloat16).eps * b.hidden_states.float().abs()
        assert (diff <= ulp + 1e-6).all(), f"sample {sample_id}: {diff.max()}"

    # A third launch finds nothing to do and leaves the result as it was.
    again = launch(prepared_root, run_name, 1)
    assert again.returncode == 0, again.stderr[-3000:]
    assert read_manifest(states)["shards"] == manifest["shards"]


def _limit_file_size(limit_bytes: int):
    def preexec():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, limit_bytes))
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes fail with EFBIG instead
    return preexec


def test_full_disk_fails_clearly_and_marks_nothing_complete(prepared_root):
    """The kernel refuses writes past RLIMIT_FSIZE, as a full disk refuses them (EFBIG here,
    ENOSPC there): the same failed write() reaches the same code path."""
    run_name = "fulldisk"
    result = launch(prepared_root, run_name, 1, ["extract.shard_max_bytes=1000000"],
                    preexec_fn=_limit_file_size(100_000))
    assert result.returncode != 0
    assert "could not write" in result.stderr and "shards/" in result.stderr
    states = Path(prepared_root) / run_name / "states"
    manifest = read_manifest(states)
    assert manifest is not None and not manifest["complete"] and manifest["num_samples"] == 0
    assert not list((states / "shards").glob("*.tmp")) and not list((states / "shards").glob(".*"))

    result = launch(prepared_root, run_name, 1)  # space again: the same run completes
    assert result.returncode == 0, result.stderr[-3000:]
    assert read_manifest(states)["complete"]
