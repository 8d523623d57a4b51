"""Teacher-forced acceptance on held-out sequences: tau_sim and per-slot accuracy.

Every response position p of a held-out sequence anchors a block, scored against the target's
own tokens: L(p) = 1 + the number of leading slots whose argmax equals the label. Greedy
speculative decoding does not visit every position: after a step at p it continues at p + L(p).
`tau_sim` replays that walk from the first response position and averages L over the visited
positions, so it is the acceptance length that serving reports when the responses are the
target's greedy continuations (tests/integration/test_reference.py checks it against z-lab's
`dflash_generate`). `tau_per_position` is the plain mean of L over all positions, higher, since
long acceptances cover many positions but are one step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

import torch

from dflash.drafter.objective import acceptance_lengths, run_blocks, valid_anchor_positions


@dataclass
class AcceptanceTotals:
    """Sums over sequences; add them across ranks, then read the ratios."""

    walk_steps: int = 0
    walk_length_sum: float = 0.0
    num_blocks: int = 0
    block_length_sum: float = 0.0
    correct_per_slot: list[int] = field(default_factory=list)
    valid_per_slot: list[int] = field(default_factory=list)
    num_sequences: int = 0
    num_skipped: int = 0
    """Sequences without a response position to anchor on."""

    _SCALARS = ("walk_steps", "walk_length_sum", "num_blocks", "block_length_sum", "num_sequences", "num_skipped")

    def as_tensor(self, device) -> torch.Tensor:
        return torch.tensor([getattr(self, k) for k in self._SCALARS] + self.correct_per_slot + self.valid_per_slot,
                            dtype=torch.float64, device=device)

    @classmethod
    def from_tensor(cls, t: torch.Tensor, block_size: int) -> "AcceptanceTotals":
        v = t.tolist()
        n = len(cls._SCALARS)
        totals = cls(correct_per_slot=[int(x) for x in v[n:n + block_size]],
                     valid_per_slot=[int(x) for x in v[n + block_size:n + 2 * block_size]])
        for key, value in zip(cls._SCALARS, v[:n]):
            setattr(totals, key, value if key.endswith("sum") else int(value))
        return totals

    @property
    def tau_sim(self) -> float:
        """Mean acceptance length per step of the replayed greedy decoding walk."""
        return self.walk_length_sum / self.walk_steps if self.walk_steps else float("nan")

    @property
    def tau_per_position(self) -> float:
        """Mean acceptance length over blocks at every response position."""
        return self.block_length_sum / self.num_blocks if self.num_blocks else float("nan")

    @property
    def accuracy_per_slot(self) -> list[float]:
        """Accuracy of slots 1..B-1 over blocks whose label there is valid."""
        return [c / v if v else float("nan") for c, v in zip(self.correct_per_slot[1:], self.valid_per_slot[1:])]


def decoding_walk(lengths: dict[int, int]) -> list[int]:
    """The acceptance lengths greedy speculative decoding meets: start at the first anchored
    position p, go on at p + L(p); where that is not a response position (a new turn), go on
    at the next one."""
    visited, positions = [], sorted(lengths)
    index = 0
    while index < len(positions):
        p = positions[index]
        visited.append(lengths[p])
        nxt = p + lengths[p]
        while index < len(positions) and positions[index] < nxt:
            index += 1
    return visited


@torch.no_grad()
def evaluate_acceptance(drafter, embed_tokens: torch.Tensor, lm_head: torch.Tensor,
                        samples: Iterable[dict], anchors_per_forward: int, chunk_rows: int,
                        use_flex: bool) -> AcceptanceTotals:
    """AcceptanceTotals of `drafter` over `samples` (dicts as `StatesDataset` yields). Every
    response position is anchored, `anchors_per_forward` blocks per forward pass."""
    arch = getattr(drafter, "module", drafter).arch
    device = embed_tokens.device
    totals = AcceptanceTotals(correct_per_slot=[0] * arch.block_size, valid_per_slot=[0] * arch.block_size)
    for sample in samples:
        sample = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in sample.items()}
        anchors = valid_anchor_positions(sample["loss_mask"])
        if len(anchors) == 0:
            totals.num_skipped += 1
            continue
        lengths: dict[int, int] = {}
        for chunk in anchors.split(anchors_per_forward):
            scores = run_blocks(drafter, embed_tokens, lm_head, sample, chunk, 1.0, chunk_rows, use_flex)
            scored = scores.label_valid[:, 1]  # blocks with at least their first label
            block_lengths = acceptance_lengths(scores.correct, scores.label_valid)
            lengths.update((int(p), int(n)) for p, n, ok in zip(chunk.tolist(), block_lengths.tolist(),
                                                                 scored.tolist()) if ok)
            for k, (c, v) in enumerate(zip((scores.correct & scores.label_valid).sum(0).tolist(),
                                           scores.label_valid.sum(0).tolist())):
                totals.correct_per_slot[k] += c
                totals.valid_per_slot[k] += v
        walk = decoding_walk(lengths)
        totals.walk_steps += len(walk)
        totals.walk_length_sum += sum(walk)
        totals.num_blocks += len(lengths)
        totals.block_length_sum += sum(lengths.values())
        totals.num_sequences += 1
    return totals
