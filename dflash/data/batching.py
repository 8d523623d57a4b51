"""Token-budget batches over length-sorted samples, and their token-balanced assignment to ranks.

Every rank computes the same plan from the same (sample id, length) pairs, so extraction needs no
communication. Resume plans again over the samples not yet stored.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Batch:
    """Samples run in one forward, right-padded to the longest."""

    sample_ids: tuple[int, ...]
    max_length: int
    """Tokens of the longest sample = the padded length."""
    num_real_tokens: int

    @property
    def num_padded_tokens(self) -> int:
        """batch size x longest length: the compute the batch costs."""
        return len(self.sample_ids) * self.max_length


def plan_batches(sample_ids: np.ndarray, lengths: np.ndarray, token_budget: int,
                 max_batch_size: int) -> list[Batch]:
    """Cut length-sorted samples into batches with batch_size x max_length <= `token_budget` and
    batch_size <= `max_batch_size`; a sample longer than the budget goes alone.

    Longest first, so the largest activation footprint shows up in the first batch, not hours
    in. Ties are broken by sample id: the plan depends only on its inputs.
    sample_ids, lengths: [N] integer arrays.
    """
    order = np.lexsort((sample_ids, -lengths))
    batches: list[Batch] = []
    current: list[int] = []
    current_max = current_real = 0
    for index in order:
        length = int(lengths[index])
        longest = max(current_max, length)
        if current and ((len(current) + 1) * longest > token_budget or len(current) == max_batch_size):
            batches.append(Batch(tuple(current), current_max, current_real))
            current, current_max, current_real = [], 0, 0
            longest = length
        current.append(int(sample_ids[index]))
        current_max, current_real = longest, current_real + length
    if current:
        batches.append(Batch(tuple(current), current_max, current_real))
    return batches


def assign_to_ranks(batches: list[Batch], world_size: int) -> list[list[Batch]]:
    """Give each batch, largest first, to the rank with the fewest padded tokens so far (lowest
    rank on ties): ranks get equal tokens, not equal sample counts, and finish together. Each
    rank's batches keep the plan's longest-first order."""
    loads = [(0, rank) for rank in range(world_size)]  # a heap of (padded tokens, rank)
    assigned: list[list[tuple[int, Batch]]] = [[] for _ in range(world_size)]
    by_cost = sorted(range(len(batches)), key=lambda i: (-batches[i].num_padded_tokens, i))
    for i in by_cost:
        load, rank = heapq.heappop(loads)
        assigned[rank].append((i, batches[i]))
        heapq.heappush(loads, (load + batches[i].num_padded_tokens, rank))
    return [[batch for _, batch in sorted(rank_batches)] for rank_batches in assigned]
