"""`states/manifest.json`: the published description of a states dir (design.md §3).

Keys: `format_version`, `complete` (true only after every rank finished and the totals were
checked), `target` {path, num_hidden_layers, hidden_size, vocab_size, config_sha256},
`layer_ids` (z-lab convention, see `dflash.store.layers`), `dtype`, `num_samples`,
`num_tokens`, `shards` (paths relative to `states/`), `dataset_fingerprint`.
Extensions (other tools may ignore them): `shard_info` {path: {sha256, num_samples,
num_tokens, num_bytes}}, `extraction` {max_length, overlong, num_planned_samples,
num_skipped_overlong, num_truncated}, `launch_id`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dflash.atomic import read_json, write_json_atomic

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"

# Fields that decide what the stored tensors mean: a run dir holding other values is refused.
IDENTITY_FIELDS = (
    "target.config_sha256", "target.num_hidden_layers", "target.hidden_size", "target.vocab_size",
    "layer_ids", "dtype", "dataset_fingerprint", "extraction.max_length", "extraction.overlong",
)


class ManifestMismatch(ValueError):
    """The run dir holds states of another target, layers, dtype or dataset."""


def manifest_path(states_dir: Path) -> Path:
    return Path(states_dir) / MANIFEST_NAME


def read_manifest(states_dir: Path) -> dict[str, Any] | None:
    """The manifest of `states_dir`, or None when there is none yet."""
    path = manifest_path(states_dir)
    if not path.exists():
        return None
    manifest = read_json(path)
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ManifestMismatch(f"{path}: format_version {manifest.get('format_version')} is not "
                               f"{FORMAT_VERSION}, which this dflash reads")
    return manifest


def write_manifest(states_dir: Path, manifest: dict[str, Any]) -> None:
    write_json_atomic(manifest_path(states_dir), manifest)


def _get(manifest: dict[str, Any], dotted: str) -> Any:
    value: Any = manifest
    for part in dotted.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def check_compatible(existing: dict[str, Any], expected: dict[str, Any], states_dir: Path) -> None:
    """Raise ManifestMismatch naming the first identity field in which the run dir's manifest
    differs from what this run would write."""
    for key in IDENTITY_FIELDS:
        old, new = _get(existing, key), _get(expected, key)
        if old != new:
            raise ManifestMismatch(
                f"{manifest_path(states_dir)} was made with {key}={old!r}, this run has {key}={new!r}. "
                "States of different targets, layers, dtypes or datasets never mix: use another "
                "run_name, or delete the run dir to start over")


def new_manifest(target: dict[str, Any], layer_ids: list[int], dtype: str, dataset_fingerprint: str,
                 extraction: dict[str, Any]) -> dict[str, Any]:
    """An empty, incomplete manifest for a new states dir."""
    return {
        "format_version": FORMAT_VERSION, "complete": False, "target": target,
        "layer_ids": list(layer_ids), "dtype": dtype, "num_samples": 0, "num_tokens": 0,
        "shards": [], "dataset_fingerprint": dataset_fingerprint, "shard_info": {},
        "extraction": extraction,
    }
