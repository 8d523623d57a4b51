"""Shard files and the record of which shards exist.

A shard is one safetensors file holding many samples packed end to end (design.md §3):
  hidden_states [T, n_layers, H]  bf16     rows of all samples, in `sample_ids` order
                                  (or float8_e4m3fn, then also
  hidden_scales [T, n_layers]     float32  value = hidden_states * hidden_scales)
  input_ids     [T]               int32
  loss_mask     [T]               uint8    1 on tokens the drafter learns to predict
  offsets       [n+1]             int64    sample k is rows offsets[k]:offsets[k+1]
  sample_ids    [n]               int64
Shards are written atomically (`dflash.atomic`); once a shard is renamed into place its writer
appends one line {shard, sha256, num_samples, num_tokens, num_bytes} to its journal
`journal/<launch>-r<rank>.jsonl`. A shard is valid when it is listed in the manifest's
`shard_info` or in a journal, exists with that size and (when verified) that sha256. Anything
else under `shards/` is debris of a killed writer and is removed by `collect_valid_shards`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from dflash.atomic import TMP_SUFFIX

log = logging.getLogger(__name__)

SHARDS_DIR = "shards"
JOURNAL_DIR = "journal"
HASH_CHUNK_BYTES = 16 << 20


class CorruptShard(RuntimeError):
    """A shard's bytes do not match its recorded checksum or size; the message names the file."""


def shard_name(launch_id: str, rank: int, index: int) -> str:
    """Relative path (to `states/`) of a rank's `index`-th shard of a launch: unique across
    launches and world sizes, so a resumed run never overwrites a valid shard."""
    return f"{SHARDS_DIR}/{launch_id}-r{rank:04d}-{index:05d}.safetensors"


def journal_path(states_dir: Path, launch_id: str, rank: int) -> Path:
    return Path(states_dir) / JOURNAL_DIR / f"{launch_id}-r{rank:04d}.jsonl"


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def verify_shard(states_dir: Path, rel: str, info: dict[str, Any], check_hash: bool = True) -> None:
    """Raise CorruptShard unless `states_dir/rel` exists with the recorded size (and sha256)."""
    path = Path(states_dir) / rel
    if not path.exists():
        raise CorruptShard(f"shard {path} is listed but missing")
    size = path.stat().st_size
    if size != info["num_bytes"]:
        raise CorruptShard(f"shard {path} has {size} bytes, {info['num_bytes']} were written")
    if check_hash and sha256_file(path) != info["sha256"]:
        raise CorruptShard(f"shard {path} fails its sha256 checksum: the file is corrupt; delete it "
                           "and re-run stage=extract to extract its samples again")


def read_journals(states_dir: Path) -> dict[str, dict[str, Any]]:
    """Shard records from every journal; a torn last line (killed writer) is ignored."""
    records: dict[str, dict[str, Any]] = {}
    journal_dir = Path(states_dir) / JOURNAL_DIR
    if not journal_dir.exists():
        return records
    for path in sorted(journal_dir.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            records[record.pop("shard")] = record
    return records


def append_journal(path: Path, rel: str, info: dict[str, Any]) -> None:
    """Append one shard record and fsync it (after the shard itself is durable)."""
    with open(path, "a") as f:
        f.write(json.dumps({"shard": rel, **info}) + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_shard_index(path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(`sample_ids` [n] int64, `offsets` [n+1] int64) of a shard, without reading its states."""
    with safe_open(str(path), framework="pt") as f:
        return f.get_tensor("sample_ids"), f.get_tensor("offsets")


def collect_valid_shards(states_dir: Path, known: dict[str, dict[str, Any]],
                         verify_new: bool) -> dict[str, dict[str, Any]]:
    """All valid shards of `states_dir`: those in `known` (the manifest's `shard_info`) and
    those journaled since. Journaled shards not yet in `known` are checked against their sha256
    when `verify_new` (after a crash that is where damage would be). Shard files that are not
    valid, and temporary files, are deleted. Call only while no writer runs (rank 0, between
    barriers). Raises CorruptShard if a shard listed in the manifest is missing or damaged."""
    states_dir = Path(states_dir)
    valid: dict[str, dict[str, Any]] = {}
    for rel, info in known.items():
        verify_shard(states_dir, rel, info, check_hash=False)
        valid[rel] = info
    for rel, info in read_journals(states_dir).items():
        if rel in valid:
            continue
        try:
            verify_shard(states_dir, rel, info, check_hash=verify_new)
        except CorruptShard as exc:
            log.warning("dropping journaled shard: %s", exc)
            continue
        valid[rel] = info
    shards_dir = states_dir / SHARDS_DIR
    for path in sorted(shards_dir.glob("*")) if shards_dir.exists() else []:
        rel = f"{SHARDS_DIR}/{path.name}"
        if rel not in valid:
            kind = "temporary file" if path.name.endswith(TMP_SUFFIX) else "unjournaled shard"
            log.info("removing %s %s (left by an interrupted writer)", kind, path)
            path.unlink()
    return dict(sorted(valid.items()))


_SAFETENSORS_DTYPES = {torch.bfloat16: "BF16", torch.float8_e4m3fn: "F8_E4M3", torch.float32: "F32",
                       torch.float16: "F16", torch.int64: "I64", torch.int32: "I32", torch.uint8: "U8"}


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> str:
    """Write `tensors` as a safetensors file at `path` and return the file's sha256.

    The layout is safetensors' own (8-byte header length, JSON header with dtype, shape and
    data_offsets, padded to 8 bytes, then the raw tensors); files are read with safetensors'
    `safe_open`. Written here rather than with `safetensors.torch.save_file` because that call
    holds the GIL for the whole write (a 1 GB shard stalls the compute thread's kernel launches
    for the duration), while `file.write` and `hashlib` on large buffers release it; and the
    checksum is taken on the way out instead of by reading the file back."""
    order = sorted(tensors, key=lambda name: (-tensors[name].element_size(), name))  # keeps alignment
    header: dict = {"__metadata__": metadata}
    offset = 0
    for name in order:
        t = tensors[name]
        size = t.numel() * t.element_size()
        header[name] = {"dtype": _SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)
    digest = hashlib.sha256()
    with open(path, "wb") as f:
        for chunk in (len(header_bytes).to_bytes(8, "little"), header_bytes):
            f.write(chunk)
            digest.update(chunk)
        for name in order:
            data = memoryview(tensors[name].contiguous().reshape(-1).view(torch.uint8).numpy())
            f.write(data)
            digest.update(data)
    return digest.hexdigest()
