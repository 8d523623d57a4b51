"""The train and eval stages in this process on the tiny target: artifacts and faults."""

import json
from pathlib import Path

import pytest

from conftest import compose_config, run_extract, small_overrides
from dflash.drafter.export import IncompatibleDrafter
from dflash.main import run_stages
from dflash.store import CorruptShard, IncompleteStates
from dflash.store.manifest import read_manifest, write_manifest

TRAIN = ["train.num_epochs=1", "train.num_workers=0", "train.checkpoint_every_steps=20",
         "train.log_every_steps=5", "train.eval_fraction=0.2"]


def run(root, run_name, stage, extra=()):
    cfg = compose_config(small_overrides(root, run_name) + [f"stage={stage}", *TRAIN, *extra])
    run_stages(cfg)
    return cfg


@pytest.fixture(scope="module")
def trained(prepared_root):
    run_extract(prepared_root, "trained")
    return run(prepared_root, "trained", "train")


def test_train_writes_checkpoints_and_export_then_eval(trained, prepared_root):
    run_dir = Path(trained.run_dir)
    steps = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*"))
    assert steps and all((run_dir / "checkpoints" / s / "trainer_state.json").exists() for s in steps)
    assert (run_dir / "export" / "model.safetensors").exists()
    run(prepared_root, "trained", "eval")
    result = json.loads((run_dir / "eval.json").read_text())
    assert result["num_sequences"] > 0 and result["tau_sim"] >= 1.0
    assert len(result["accuracy_per_slot"]) == trained.drafter.block_size - 1


def test_train_refuses_unfinished_extraction(trained, prepared_root, tmp_path):
    states = Path(trained.run_dir) / "states"
    manifest = read_manifest(states)
    write_manifest(states, dict(manifest, complete=False))
    try:
        with pytest.raises(IncompleteStates, match="extraction is unfinished"):
            run(prepared_root, "trained", "train")
    finally:
        write_manifest(states, manifest)


def test_train_names_a_corrupt_shard(prepared_root):
    run_extract(prepared_root, "corrupt")
    states = Path(prepared_root) / "corrupt" / "states"
    rel = read_manifest(states)["shards"][0]
    data = bytearray((states / rel).read_bytes())
    data[len(data) // 2] ^= 0x10
    (states / rel).write_bytes(bytes(data))
    with pytest.raises(CorruptShard, match=Path(rel).name):
        run(prepared_root, "corrupt", "train")


def test_mask_token_outside_the_vocabulary(trained, prepared_root):
    with pytest.raises(IncompatibleDrafter, match="drafter.mask_token_id"):
        run(prepared_root, "trained", "train", ["drafter.mask_token_id=5000"])


def test_drafter_for_other_layers(trained, prepared_root):
    with pytest.raises(IncompatibleDrafter, match="drafter.target_layer_ids"):
        run(prepared_root, "trained", "train", ["drafter.target_layer_ids=[1,16,31,46,61]"])


def test_sequences_without_response_are_skipped_and_counted(prepared_root, tmp_path, caplog):
    rows = [{"sample_id": i, "input_ids": [1 + i, 2, 3, 4, 5, 6, 7, 8], "loss_mask": [0, 0, 0, 1, 1, 1, 1, 1]}
            for i in range(12)]
    rows += [{"sample_id": 100, "input_ids": [9, 8, 7, 6], "loss_mask": [0, 0, 0, 0]},
             {"sample_id": 101, "input_ids": [9, 8, 7, 6], "loss_mask": [0, 0, 0, 1]}]  # last token only
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = ["data=file", f"data.path={path}", f"data.prepared_dir={prepared_root}/noresp/prepared",
            "train.eval_fraction=0.01"]
    run_extract(prepared_root, "noresp", data)
    with caplog.at_level("INFO"):
        run(prepared_root, "noresp", "train", data + ["train.eval_fraction=0.01"])
    assert "2 sequences without response tokens to anchor on were skipped" in caplog.text
    # None of these 14 ids falls in a 1% held-out split: eval says so instead of writing tau NaN.
    assert "no held-out samples among the 14 stored" in caplog.text
    stale = Path(prepared_root) / "noresp" / "eval.json"
    stale.write_text("{}")
    caplog.clear()
    with caplog.at_level("INFO"):
        run(prepared_root, "noresp", "eval", data)
    assert "nothing evaluated, no eval.json written" in caplog.text and not stale.exists()
