"""Shared fixtures: the real Hydra config composed with small CPU overrides in a tmp dir, a
prepared tiny target + synthetic dataset built once per session, and launch helpers."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from dflash.config import Config, register_configs, resolve_config
from dflash.main import run_stages

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))  # tests/wandb_records.py

register_configs()


def small_overrides(root: Path, run_name: str = "test") -> list[str]:
    """Overrides that make a run tiny, fast and CPU-only, sharing one prepared dataset."""
    return [
        f"output_root={root}", f"run_name={run_name}", f"data.prepared_dir={root}/prepared",
        "data.num_samples=48", "data.max_prompt_length=64", "data.max_response_length=24",
        "data.prompt_length_mean=32", "data.response_length_mean=16", "data.generation_batch_size=48",
        "device=cpu", "extract.token_budget=512", "extract.progress_interval_s=0.2",
        "barrier.timeout_s=120", "barrier.poll_s=0.05", "wandb.mode=disabled",
    ]


def qwen35_architecture(**overrides) -> dict:
    """The embedded tiny target's `Qwen3_5TextConfig` arguments (conf/model/tiny.yaml) with
    `overrides` merged in (a nested dict such as rope_parameters merges key by key)."""
    tiny = OmegaConf.load(REPO / "conf" / "model" / "tiny.yaml").architecture
    return OmegaConf.to_container(OmegaConf.merge(tiny, overrides))


def compose_config(overrides: list[str]) -> Config:
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return resolve_config(compose(config_name="config", overrides=overrides))


@pytest.fixture(scope="session")
def prepared_root(tmp_path_factory) -> Path:
    """An output root holding the embedded tiny target and a prepared synthetic dataset."""
    root = tmp_path_factory.mktemp("dflash")
    run_stages(compose_config(small_overrides(root, "prepare") + ["stage=prepare"]))
    return root


def run_extract(root: Path, run_name: str, extra: list[str] = ()) -> Config:
    """Run stage=extract in this process (rank 0 of 1); returns its config."""
    cfg = compose_config(small_overrides(root, run_name) + ["stage=extract", *extra])
    run_stages(cfg)
    return cfg


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main_command(num_processes: int) -> list[str]:
    """The command line that starts dflash/main.py on `num_processes` CPU ranks."""
    if num_processes == 1:
        return [sys.executable, str(REPO / "dflash" / "main.py")]
    return [str(Path(sys.executable).parent / "accelerate"), "launch",
            "--config_file", str(REPO / "launch" / "cpu_2proc.yaml"),
            "--num_processes", str(num_processes), "--main_process_port", str(free_port()),
            str(REPO / "dflash" / "main.py")]


def launch(root: Path, run_name: str, num_processes: int, extra: list[str] = (),
           **kwargs) -> subprocess.CompletedProcess:
    """Run stage=extract as a user would, through `accelerate launch` for several processes."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run(main_command(num_processes) + small_overrides(root, run_name) + list(extra),
                          cwd=root, env=env, capture_output=True, text=True, timeout=600, **kwargs)
