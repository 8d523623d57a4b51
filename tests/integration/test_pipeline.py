"""stage=all through `accelerate launch` on 2 CPU ranks: extract -> train -> eval -> export,
conformance with z-lab's reference implementation, the learning check, W&B, kill -9 resume."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import REPO, free_port, launch, main_command, small_overrides
from dflash.drafter.data import StatesDataset, split_ids
from dflash.drafter.evaluate import evaluate_acceptance
from dflash.drafter.export import load_export
from dflash.drafter.model import DFlashDrafter
from dflash.store import StateReader
from dflash.target.embeddings import load_embeddings
from wandb_records import read_history

pytestmark = pytest.mark.slow

# The demo's data and drafter, trained for 4 epochs: enough for the drafter to learn the tiny
# target's continuations (a few minutes on 2 CPU cores).
DEMO = ["data.num_samples=256", "train.num_epochs=4", "train.eval_fraction=0.1", "train.num_workers=1",
        "wandb.mode=offline"]
MARGIN = 0.10  # relative: reference acceptance vs our tau_sim (bf16-stored vs fp32 features, final-step cut)


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipeline")
    command = [str(Path(sys.executable).parent / "accelerate"), "launch", "--config_file",
               str(REPO / "launch" / "cpu_2proc.yaml"), "--main_process_port", str(free_port()),
               str(REPO / "dflash" / "main.py"), f"output_root={root}", "run_name=demo", *DEMO]
    result = subprocess.run(command, cwd=root, capture_output=True, text=True, timeout=1200,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert result.returncode == 0, result.stderr[-5000:]
    return root / "demo", result


@pytest.fixture(scope="module")
def reference_site(tmp_path_factory):
    """z-lab's reference package (PyPI dflash 0.1.0), installed alone and renamed zlab_dflash:
    its import name is ours."""
    site = tmp_path_factory.mktemp("reference")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site / "pkg"),
                    "dflash==0.1.0"], check=True, capture_output=True)
    (site / "pkg" / "dflash").rename(site / "zlab_dflash")
    return site


def test_one_launch_runs_every_stage(demo):
    run_dir, result = demo
    assert json.loads((run_dir / "states" / "manifest.json").read_text())["complete"]
    assert {p.name for p in (run_dir / "export").iterdir()} == {"config.json", "model.safetensors"}
    assert (run_dir / "eval.json").exists()
    assert "rank 1" in result.stderr and "exported the drafter" in result.stderr


def heldout(run_dir):
    reader = StateReader(run_dir / "states")
    _, ids = split_ids(reader.sample_ids, 0.1, 0)
    return StatesDataset(run_dir / "states", ids), reader.manifest["target"]["path"]


def test_learning_check(demo):
    """The trained drafter's held-out tau_sim is clearly above an untrained one's."""
    run_dir, _ = demo
    result = json.loads((run_dir / "eval.json").read_text())
    data, target = heldout(run_dir)
    embed, head = load_embeddings(target, torch.float32, "cpu")
    torch.manual_seed(0)
    untrained = DFlashDrafter(load_export(run_dir / "export").arch)
    base = evaluate_acceptance(untrained, embed, head, (data[i] for i in range(len(data))), 512, 1024, False)
    assert base.tau_sim < 1.1
    assert result["tau_sim"] > base.tau_sim + 0.5, (result, base.tau_sim)
    assert result["tau_per_position"] >= result["tau_sim"]


def test_reference_loads_our_export_and_agrees(demo, reference_site, tmp_path):
    run_dir, _ = demo
    ours = load_export(run_dir / "export")
    data, target = heldout(run_dir)
    embed, _ = load_embeddings(target, torch.float32, "cpu")
    sample = data[0]
    anchor = int(sample["loss_mask"].nonzero()[2])
    block = torch.full((ours.arch.block_size,), ours.arch.mask_token_id)
    block[0] = sample["input_ids"][anchor]
    prompts, max_new = [], []
    for i in range(len(data)):
        first = int(data[i]["loss_mask"].nonzero()[0])
        prompts.append(data[i]["input_ids"][:first])
        max_new.append(len(data[i]["input_ids"]) - first)
    inputs = {"target_hidden": sample["hidden"][None, :anchor].float(), "noise_embedding": embed[block][None],
              "position_ids": torch.arange(anchor + ours.arch.block_size)[None],
              "prompts": prompts, "max_new_tokens": max_new}
    torch.save(inputs, tmp_path / "inputs.pt")
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "reference_runner.py"), str(reference_site),
                           str(run_dir / "export"), target, str(tmp_path / "inputs.pt"), str(tmp_path / "out.pt")],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-5000:]
    out = torch.load(tmp_path / "out.pt")
    # (a) it loaded our export, with our layer ids, block size and mask token
    assert out["target_layer_ids"] == list(ours.arch.target_layer_ids)
    assert out["block_size"] == ours.arch.block_size and out["mask_token_id"] == ours.arch.mask_token_id
    # (b) the same draft hidden states on the same inputs, fp32
    with torch.no_grad():
        mine = ours.forward_block(inputs["target_hidden"], inputs["noise_embedding"], inputs["position_ids"])
    torch.testing.assert_close(out["hidden"], mine, rtol=1e-5, atol=1e-5)
    # (c) its greedy speculative decoding reproduces the target's responses, and its acceptance
    # lengths agree with our teacher-forced tau_sim
    for o, i in zip(out["output_ids"], range(len(data))):
        assert torch.equal(o, data[i]["input_ids"][: len(o)])
    lengths = [n for per_prompt in out["acceptance_lengths"] for n in per_prompt]
    reference_tau = sum(lengths) / len(lengths)
    tau_sim = json.loads((run_dir / "eval.json").read_text())["tau_sim"]
    print(f"reference acceptance {reference_tau:.3f} over {len(lengths)} steps; our tau_sim {tau_sim:.3f}")
    assert abs(reference_tau - tau_sim) <= MARGIN * tau_sim, (reference_tau, tau_sim)


def test_wandb_run_has_extract_train_and_eval(demo):
    run_dir, _ = demo
    (offline,) = (run_dir / "wandb").glob("offline-run-*")
    rows, summary = read_history(offline)
    logged = {key for row in rows for key in row}
    for key in ("extract/throughput(tokens/s)", "train/step", "train/loss", "train/lr", "train/grad_norm",
                "train/accuracy/slot_01", "train/acceptance_per_block", "train/throughput(tokens/s)",
                "train/throughput(samples/s)", "train/dataloader_wait(fraction)"):
        assert key in logged, key
    assert "eval/tau_sim" in summary and "extract/complete" in summary


def test_kill_9_during_training_resumes_from_the_last_checkpoint(prepared_root):
    """Same final step count as an uninterrupted run: epochs x steps per epoch."""
    run_name = "killtrain"
    train = ["stage=train", "train.num_epochs=8", "train.checkpoint_every_steps=10", "train.num_workers=0",
             "train.log_every_steps=10"]
    assert launch(prepared_root, run_name, 1, ["stage=extract"]).returncode == 0
    ckpts = Path(prepared_root) / run_name / "checkpoints"
    proc = subprocess.Popen(main_command(1) + small_overrides(prepared_root, run_name) + train,
                            cwd=prepared_root, start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while not list(ckpts.glob("step_*/trainer_state.json")):
        assert proc.poll() is None, "training ended before it could be killed"
        assert time.monotonic() < deadline
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    killed_at = max(int(p.parent.name.split("_")[1]) for p in ckpts.glob("step_*/trainer_state.json"))
    result = launch(prepared_root, run_name, 1, train)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"resumed from {ckpts}/step_{killed_at:08d}" in result.stderr
    num_train = len(split_ids(StateReader(Path(prepared_root) / run_name / "states").sample_ids, 0.05, 0)[0])
    final = json.loads(max(ckpts.glob("step_*/trainer_state.json")).read_text())
    assert final["step"] == 8 * num_train  # one sequence per step on one rank
