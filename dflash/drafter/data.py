"""Training data of the drafter: the held-out split and a dataset over the stored states."""

from __future__ import annotations

import hashlib
from pathlib import Path

from torch.utils.data import Dataset

from dflash.store import StateReader


def is_heldout(sample_id: int, fraction: float, seed: int) -> bool:
    """Whether `sample_id` belongs to the held-out split: a hash of (seed, id), so the split does
    not depend on the world size, the order of the ids or a resume."""
    digest = hashlib.sha256(f"{seed}:{sample_id}".encode()).digest()
    return int.from_bytes(digest[:8], "little") / 2**64 < fraction


def split_ids(sample_ids: list[int], fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """(train ids, held-out ids), both sorted."""
    heldout = [s for s in sample_ids if is_heldout(s, fraction, seed)]
    chosen = set(heldout)
    return [s for s in sample_ids if s not in chosen], heldout


class StatesDataset(Dataset):
    """Samples of a states dir by index into `sample_ids`. Each worker process opens its own
    memory-mapped reader; nothing but the requested sample is read.

    Item: {sample_id: int, hidden [S, F*H] bfloat16 (fp8 shards dequantized), input_ids [S] int64,
    loss_mask [S] bool}.
    """

    def __init__(self, states_dir: str | Path, sample_ids: list[int]):
        self.states_dir, self.sample_ids = Path(states_dir), list(sample_ids)
        self._reader: StateReader | None = None

    def __len__(self) -> int:
        return len(self.sample_ids)

    def __getitem__(self, index: int) -> dict:
        if self._reader is None:
            self._reader = StateReader(self.states_dir)
        sample = self._reader[self.sample_ids[index]]
        seq_len = sample.hidden_states.shape[0]
        return {"sample_id": sample.sample_id,
                "hidden": sample.hidden_states.reshape(seq_len, -1),
                "input_ids": sample.input_ids.long(),
                "loss_mask": sample.loss_mask.bool()}


def first(batch: list[dict]) -> dict:
    """collate_fn for one sequence per micro-batch."""
    return batch[0]


