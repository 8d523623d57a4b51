"""The on-disk format: shard writer, consolidation after crashes, reader, manifest identity."""

import json
import shutil

import numpy as np
import pytest
import torch

from dflash.store import CorruptShard, IncompleteStates, StateReader
from dflash.store.consolidate import consolidate
from dflash.store.manifest import ManifestMismatch, check_compatible, new_manifest, read_manifest, write_manifest
from dflash.store.shards import read_journals
from dflash.store.writer import CapturedBatch, ShardWriter

NUM_LAYERS, HIDDEN = 3, 8


def make_batches(seed=0, num_batches=5, batch_size=4):
    """Random right-padded batches and the per-sample truth {id: (hidden, ids, mask)}."""
    gen = torch.Generator().manual_seed(seed)
    batches, truth, next_id = [], {}, 100
    for _ in range(num_batches):
        lengths = torch.randint(1, 30, (batch_size,), generator=gen).tolist()
        seq = max(lengths)
        hidden = torch.randn(batch_size, seq, NUM_LAYERS, HIDDEN, generator=gen).to(torch.bfloat16)
        ids = torch.randint(0, 1000, (batch_size, seq), generator=gen)
        mask = torch.randint(0, 2, (batch_size, seq), generator=gen).to(torch.uint8)
        sample_ids = list(range(next_id, next_id + batch_size))
        next_id += batch_size
        for b, s in enumerate(sample_ids):
            truth[s] = (hidden[b, :lengths[b]], ids[b, :lengths[b]], mask[b, :lengths[b]])
        batches.append(CapturedBatch(hidden, None, ids, mask, lengths, sample_ids, [1, 3, 5]))
    return batches, truth


def fresh_manifest():
    target = {"path": "/x", "num_hidden_layers": 12, "hidden_size": HIDDEN, "vocab_size": 1000,
              "config_sha256": "abc"}
    return new_manifest(target, [1, 3, 5], "bfloat16", "fp", {"max_length": 4096, "overlong": "truncate"})


def write_states(states_dir, batches, launch_id="launch", shard_max_bytes=2000):
    states_dir.mkdir(parents=True, exist_ok=True)
    writer = ShardWriter(states_dir, launch_id, 0, shard_max_bytes, queue_batches=2)
    for batch in batches:
        writer.put(batch)
    return writer.close()


def complete(states_dir, manifest):
    consolidate(states_dir, manifest, verify_new=True)
    manifest["complete"] = True
    write_manifest(states_dir, manifest)


def test_roundtrip_random_access(tmp_path):
    batches, truth = make_batches()
    stats = write_states(tmp_path, batches)
    assert stats.num_shards > 1 and stats.num_samples == len(truth)
    complete(tmp_path, fresh_manifest())
    reader = StateReader(tmp_path)
    assert reader.sample_ids == sorted(truth)
    for sample_id in reversed(sorted(truth)):
        hidden, ids, mask = truth[sample_id]
        sample = reader[sample_id]
        assert sample.hidden_states.dtype == torch.bfloat16
        assert torch.equal(sample.hidden_states, hidden)
        assert torch.equal(sample.input_ids, ids.to(torch.int32))
        assert torch.equal(sample.loss_mask, mask)
        assert reader.length(sample_id) == len(ids)
    manifest = read_manifest(tmp_path)
    assert manifest["num_samples"] == len(truth)
    assert manifest["num_tokens"] == sum(len(t[1]) for t in truth.values())
    reader.verify()
    with pytest.raises(KeyError, match="sample id 1"):
        reader[1]


def test_reader_refuses_incomplete_states(tmp_path):
    batches, _ = make_batches()
    write_states(tmp_path, batches)
    consolidate(tmp_path, fresh_manifest(), verify_new=True)
    with pytest.raises(IncompleteStates, match="extraction is unfinished"):
        StateReader(tmp_path)
    assert len(StateReader(tmp_path, require_complete=False)) == 20


def test_debris_of_a_killed_writer_is_removed(tmp_path):
    batches, truth = make_batches()
    write_states(tmp_path, batches)
    shards = tmp_path / "shards"
    # A shard renamed into place but never journaled, and a half-written temporary file.
    shutil.copy(next(shards.iterdir()), shards / "dead-r0000-00000.safetensors")
    (shards / ".dead-r0001-00000.safetensors.123.tmp").write_bytes(b"half")
    where = consolidate(tmp_path, fresh_manifest(), verify_new=True)
    assert sorted(where) == sorted(truth)
    assert not (shards / "dead-r0000-00000.safetensors").exists()
    assert not list(shards.glob("*.tmp"))


def test_torn_journal_line_and_corrupt_new_shard_are_dropped(tmp_path):
    batches, truth = make_batches()
    write_states(tmp_path, batches)
    journal = next((tmp_path / "journal").iterdir())
    with open(journal, "a") as f:
        f.write('{"shard": "shards/x.safet')  # killed mid-line
    records = read_journals(tmp_path)
    first = sorted(records)[0]
    data = bytearray((tmp_path / first).read_bytes())
    data[-1] ^= 0xFF
    (tmp_path / first).write_bytes(bytes(data))
    where = consolidate(tmp_path, fresh_manifest(), verify_new=True)
    assert first not in where.values()
    assert 0 < len(where) < len(truth)  # the corrupt shard's samples will be extracted again


def test_verify_names_the_corrupt_shard(tmp_path):
    batches, _ = make_batches()
    write_states(tmp_path, batches)
    complete(tmp_path, fresh_manifest())
    rel = read_manifest(tmp_path)["shards"][1]
    data = bytearray((tmp_path / rel).read_bytes())
    data[len(data) // 2] ^= 0x01
    (tmp_path / rel).write_bytes(bytes(data))
    with pytest.raises(CorruptShard, match=rel.split("/")[-1]):
        StateReader(tmp_path).verify()


def test_missing_listed_shard_is_an_error(tmp_path):
    batches, _ = make_batches()
    write_states(tmp_path, batches)
    complete(tmp_path, manifest := fresh_manifest())
    (tmp_path / manifest["shards"][0]).unlink()
    with pytest.raises(CorruptShard, match="missing"):
        consolidate(tmp_path, read_manifest(tmp_path), verify_new=False)


def test_writer_error_reaches_the_compute_thread(tmp_path):
    batches, _ = make_batches()
    writer = ShardWriter(tmp_path, "launch", 0, shard_max_bytes=1, queue_batches=1)
    shutil.rmtree(tmp_path / "shards")
    (tmp_path / "shards").write_text("not a directory")  # every shard write now fails
    with pytest.raises(RuntimeError, match="shard writer failed.*could not write"):
        for batch in batches:
            writer.put(batch)
        writer.close()
    assert not read_journals(tmp_path)


@pytest.mark.parametrize("field, value", [
    ("dtype", "float8_e4m3fn"), ("layer_ids", [1, 2, 3]), ("dataset_fingerprint", "other")])
def test_manifest_of_another_run_is_refused(tmp_path, field, value):
    other = fresh_manifest()
    other[field] = value
    with pytest.raises(ManifestMismatch, match=field):
        check_compatible(fresh_manifest(), other, tmp_path)
    other = fresh_manifest()
    other["target"]["config_sha256"] = "def"
    with pytest.raises(ManifestMismatch, match="target.config_sha256"):
        check_compatible(fresh_manifest(), other, tmp_path)


def test_manifest_has_the_published_keys(tmp_path):
    batches, _ = make_batches()
    write_states(tmp_path, batches)
    complete(tmp_path, fresh_manifest())
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    for key in ("format_version", "complete", "target", "layer_ids", "dtype", "num_samples",
                "num_tokens", "shards", "dataset_fingerprint"):
        assert key in manifest
    assert set(manifest["target"]) == {"path", "num_hidden_layers", "hidden_size", "vocab_size", "config_sha256"}
    assert all(not s.startswith("/") for s in manifest["shards"])
    from safetensors import safe_open
    with safe_open(str(tmp_path / manifest["shards"][0]), "pt") as f:
        assert set(f.keys()) == {"hidden_states", "input_ids", "loss_mask", "offsets", "sample_ids"}
        assert f.get_slice("hidden_states").get_dtype() == "BF16"
        assert f.get_slice("input_ids").get_dtype() == "I32"
        assert f.get_slice("loss_mask").get_dtype() == "U8"
        offsets = f.get_tensor("offsets")
        assert offsets.dtype == torch.int64 and offsets[0] == 0
        assert f.get_slice("hidden_states").get_shape()[0] == int(offsets[-1])
        assert np.all(np.diff(offsets.numpy()) > 0)


def test_write_safetensors_is_read_by_safetensors(tmp_path):
    import hashlib

    from safetensors.torch import load_file

    from dflash.store.shards import write_safetensors

    tensors = {"hidden_states": torch.randn(5, 3, 8).to(torch.bfloat16),
               "hidden_scales": torch.rand(5, 3), "fp8": torch.randn(4, 4).to(torch.float8_e4m3fn),
               "input_ids": torch.arange(5, dtype=torch.int32), "loss_mask": torch.ones(5, dtype=torch.uint8),
               "offsets": torch.tensor([0, 2, 5])}
    digest = write_safetensors(tmp_path / "x.safetensors", tensors, {"format": "pt"})
    assert digest == hashlib.sha256((tmp_path / "x.safetensors").read_bytes()).hexdigest()
    loaded = load_file(str(tmp_path / "x.safetensors"))
    assert loaded.keys() == tensors.keys()
    for name, t in tensors.items():
        assert loaded[name].dtype == t.dtype and torch.equal(loaded[name].view(torch.uint8), t.view(torch.uint8))
