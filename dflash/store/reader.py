"""Reader of a states dir: random access by sample id, memory-mapped.

    reader = StateReader("outputs/demo/states")
    sample = reader[sample_id]      # StoredSample: hidden_states [T, n_layers, H], input_ids [T], loss_mask [T]

Only shards listed in a complete manifest are read. Each shard is opened with safetensors'
`safe_open` (an mmap); a sample's rows are sliced from it, so nothing but the requested rows is
read from disk and the dataset is never held in memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors import safe_open

from dflash.store.manifest import manifest_path, read_manifest
from dflash.store.shards import read_shard_index, verify_shard


class IncompleteStates(RuntimeError):
    """The states dir has no complete manifest: extraction is unfinished."""


@dataclass
class StoredSample:
    sample_id: int
    hidden_states: torch.Tensor
    """[T, n_layers, H] bfloat16 (fp8 shards dequantized); layer k is `layer_ids[k]` (z-lab convention)."""
    input_ids: torch.Tensor
    """[T] int32."""
    loss_mask: torch.Tensor
    """[T] uint8, 1 on tokens the drafter learns to predict."""


class StateReader:
    """Random access to the samples of a complete states dir. `max_open_shards` bounds the open
    mmaps."""

    def __init__(self, states_dir: str | Path, require_complete: bool = True, max_open_shards: int = 64):
        self.states_dir = Path(states_dir)
        manifest = read_manifest(self.states_dir)
        if manifest is None:
            raise IncompleteStates(f"{manifest_path(self.states_dir)} does not exist: run stage=extract first")
        if require_complete and not manifest["complete"]:
            raise IncompleteStates(
                f"{manifest_path(self.states_dir)} is not complete: extraction is unfinished "
                f"({manifest['num_samples']} samples stored so far). Re-run stage=extract with the "
                "same run_name to finish it")
        self.manifest: dict[str, Any] = manifest
        self.layer_ids: list[int] = manifest["layer_ids"]
        self._location: dict[int, tuple[int, int, int]] = {}
        self._shards: list[str] = list(manifest["shards"])
        for index, rel in enumerate(self._shards):
            sample_ids, offsets = read_shard_index(self.states_dir / rel)
            for k, sample_id in enumerate(sample_ids.tolist()):
                self._location[sample_id] = (index, int(offsets[k]), int(offsets[k + 1]))
        self._open = lru_cache(maxsize=max_open_shards)(self._open_shard)

    def _open_shard(self, index: int):
        return safe_open(str(self.states_dir / self._shards[index]), framework="pt")

    def __len__(self) -> int:
        return len(self._location)

    @property
    def sample_ids(self) -> list[int]:
        return sorted(self._location)

    def __contains__(self, sample_id: int) -> bool:
        return sample_id in self._location

    def __iter__(self) -> Iterator[StoredSample]:
        for sample_id in self.sample_ids:
            yield self[sample_id]

    def length(self, sample_id: int) -> int:
        """Tokens of a sample, without reading it."""
        _, start, end = self._location[sample_id]
        return end - start

    def __getitem__(self, sample_id: int) -> StoredSample:
        try:
            index, start, end = self._location[sample_id]
        except KeyError:
            raise KeyError(f"sample id {sample_id} is not in {self.states_dir}") from None
        f = self._open(index)
        hidden = f.get_slice("hidden_states")[start:end]
        if hidden.dtype == torch.float8_e4m3fn:
            hidden = (hidden.float() * f.get_slice("hidden_scales")[start:end][..., None]).to(torch.bfloat16)
        return StoredSample(
            sample_id=sample_id,
            hidden_states=hidden,
            input_ids=f.get_slice("input_ids")[start:end],
            loss_mask=f.get_slice("loss_mask")[start:end])

    def verify(self) -> None:
        """Check every shard's size and sha256 against the manifest; raises CorruptShard naming
        the first bad file."""
        for rel in self._shards:
            verify_shard(self.states_dir, rel, self.manifest["shard_info"][rel])
