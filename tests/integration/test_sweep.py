"""A Hydra multirun under `accelerate launch` with 2 CPU processes: every job on every rank, in
the same order, each in its own deterministic subdir, W&B runs grouped by sweep, a summary."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, free_port
from wandb_records import read_run_group

pytestmark = pytest.mark.slow


def test_token_budget_sweep_on_two_ranks(tmp_path):
    command = [str(Path(sys.executable).parent / "accelerate"), "launch", "--config_file",
               str(REPO / "launch" / "cpu_2proc.yaml"), "--main_process_port", str(free_port()),
               str(REPO / "dflash" / "main.py"), "-m", "stage=bench", "bench=smoke", f"output_root={tmp_path}",
               "run_name=budgets", "wandb.mode=offline", "bench.variants=[baseline,padded]",
               "extract.token_budget=256,1024"]
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=600,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert result.returncode == 0, result.stderr[-5000:]
    sweep = tmp_path / "budgets-sweep"
    # a job's subdir is its overrides (Hydra's override_dirname, without stage/run_name/output_root)
    fixed = "bench.variants=[baseline,padded],bench=smoke"
    jobs = [f"{fixed},extract.token_budget=1024", f"{fixed},extract.token_budget=256"]
    assert sorted(p.name for p in sweep.iterdir() if p.is_dir()) == jobs
    for job in jobs:
        assert json.loads((sweep / job / "bench.json").read_text())["token_budget"] == int(job.split("=")[-1])
        for rank in (0, 1):  # both ranks ran this job, in this dir
            assert "dflash.stages.bench" in (sweep / job / "logs" / f"rank{rank}.log").read_text()
        (offline,) = (sweep / job / "wandb").glob("offline-run-*")
        assert read_run_group(offline) == "budgets-sweep"
    # the same order on every rank: job 0 then job 1
    for rank in (0, 1):
        order = [job for job in jobs[::-1] if f"run dir {sweep / job}" in result.stderr]
        assert order == jobs[::-1]
    summary = (sweep / "sweep_summary.md").read_text()
    assert all(job in summary for job in jobs)
