"""Bring a states dir's manifest up to date with the shards that really exist.

Run by rank 0 alone while no writer runs: at the start of a launch (after a crash or kill -9 the
journals hold shards the manifest does not list yet) and at its end.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dflash.store.manifest import write_manifest
from dflash.store.shards import collect_valid_shards, read_shard_index


def stored_sample_ids(states_dir: Path, shards: list[str]) -> dict[int, str]:
    """{sample id: shard} over `shards`. Raises RuntimeError if a sample is stored twice."""
    where: dict[int, str] = {}
    for rel in shards:
        sample_ids, _ = read_shard_index(Path(states_dir) / rel)
        for sample_id in sample_ids.tolist():
            if sample_id in where:
                raise RuntimeError(f"sample id {sample_id} is stored twice, in {where[sample_id]} and {rel}")
            where[sample_id] = rel
    return where


def consolidate(states_dir: Path, manifest: dict[str, Any], verify_new: bool) -> dict[int, str]:
    """Update `manifest` in place to list exactly the valid shards (see
    `dflash.store.shards.collect_valid_shards`), recount samples and tokens and write it (still
    incomplete). Returns {sample id: shard} of the stored samples."""
    valid = collect_valid_shards(states_dir, manifest["shard_info"], verify_new)
    where = stored_sample_ids(states_dir, list(valid))
    manifest.update(
        complete=False, shards=list(valid), shard_info=valid,
        num_samples=sum(info["num_samples"] for info in valid.values()),
        num_tokens=sum(info["num_tokens"] for info in valid.values()))
    write_manifest(states_dir, manifest)
    return where
