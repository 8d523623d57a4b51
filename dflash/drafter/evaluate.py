"""Teacher-forced acceptance on held-out sequences: tau_sim and per-slot accuracy.

For every held-out sequence, blocks are anchored at its response positions (all of them, or
`max_anchors` evenly spaced) and scored against the target's own tokens. tau_sim(block) = 1 +
the number of leading slots whose argmax equals the label; it equals the acceptance length of
greedy speculative decoding when the responses are the target's greedy continuations.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

import torch

from dflash.drafter.objective import acceptance_lengths, run_blocks, spaced_anchors


@dataclass
class AcceptanceTotals:
    """Sums over blocks; add them across ranks, then read the ratios."""

    num_blocks: int = 0
    tau_sum: float = 0.0
    correct_per_slot: list[int] = field(default_factory=list)
    valid_per_slot: list[int] = field(default_factory=list)
    num_sequences: int = 0
    num_skipped: int = 0
    """Sequences without a response position to anchor on."""

    def as_tensor(self, device) -> torch.Tensor:
        return torch.tensor([self.num_blocks, self.tau_sum, self.num_sequences, self.num_skipped,
                             *self.correct_per_slot, *self.valid_per_slot], dtype=torch.float64, device=device)

    @classmethod
    def from_tensor(cls, t: torch.Tensor, block_size: int) -> "AcceptanceTotals":
        v = t.tolist()
        return cls(int(v[0]), v[1], [int(x) for x in v[4:4 + block_size]],
                   [int(x) for x in v[4 + block_size:4 + 2 * block_size]], int(v[2]), int(v[3]))

    @property
    def tau_sim(self) -> float:
        return self.tau_sum / self.num_blocks if self.num_blocks else float("nan")

    @property
    def accuracy_per_slot(self) -> list[float]:
        """Accuracy of slots 1..B-1 over blocks whose label there is valid."""
        return [c / v if v else float("nan") for c, v in zip(self.correct_per_slot[1:], self.valid_per_slot[1:])]


@torch.no_grad()
def evaluate_acceptance(drafter, embed_tokens: torch.Tensor, lm_head: torch.Tensor,
                        samples: Iterable[dict], max_anchors: int, chunk_rows: int,
                        use_flex: bool) -> AcceptanceTotals:
    """AcceptanceTotals of `drafter` over `samples` (dicts as `StatesDataset` yields)."""
    arch = getattr(drafter, "module", drafter).arch
    device = embed_tokens.device
    totals = AcceptanceTotals(correct_per_slot=[0] * arch.block_size, valid_per_slot=[0] * arch.block_size)
    for sample in samples:
        sample = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in sample.items()}
        anchors = spaced_anchors(sample["loss_mask"], max_anchors)
        if len(anchors) == 0:
            totals.num_skipped += 1
            continue
        scores = run_blocks(drafter, embed_tokens, lm_head, sample, anchors, 1.0, chunk_rows, use_flex)
        scored = scores.label_valid[:, 1]  # blocks with at least their first label
        totals.num_blocks += int(scored.sum())
        totals.tau_sum += float(acceptance_lengths(scores.correct, scores.label_valid)[scored].sum())
        for k, (c, v) in enumerate(zip((scores.correct & scores.label_valid).sum(0).tolist(),
                                       scores.label_valid.sum(0).tolist())):
            totals.correct_per_slot[k] += c
            totals.valid_per_slot[k] += v
        totals.num_sequences += 1
    return totals
