"""Properties of the token-budget plan and its assignment to ranks."""

import numpy as np
import pytest

from dflash.data.batching import assign_to_ranks, plan_batches


def random_lengths(seed: int, n: int = 2000):
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(300), 0.9, n), 1, 5000).astype(np.int64)
    ids = rng.permutation(10 * n)[:n].astype(np.int64)  # sparse, unordered ids
    return ids, lengths


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("budget, max_batch", [(4096, 64), (12000, 256), (1000, 3)])
def test_every_sample_once_and_budget_respected(seed, budget, max_batch):
    ids, lengths = random_lengths(seed)
    batches = plan_batches(ids, lengths, budget, max_batch)
    planned = [s for b in batches for s in b.sample_ids]
    assert sorted(planned) == sorted(ids.tolist())
    length_of = dict(zip(ids.tolist(), lengths.tolist()))
    for b in batches:
        assert b.max_length == max(length_of[s] for s in b.sample_ids)
        assert b.num_real_tokens == sum(length_of[s] for s in b.sample_ids)
        assert len(b.sample_ids) <= max_batch
        if len(b.sample_ids) > 1:
            assert b.num_padded_tokens <= budget
        else:  # alone: it is longer than the budget, or the next sample did not fit
            assert b.num_padded_tokens <= budget or b.max_length > budget


def test_sample_longer_than_budget_goes_alone():
    ids = np.arange(5, dtype=np.int64)
    lengths = np.array([10, 5000, 10, 10, 10], dtype=np.int64)
    batches = plan_batches(ids, lengths, 100, 64)
    assert batches[0].sample_ids == (1,) and batches[0].max_length == 5000
    assert sorted(batches[1].sample_ids) == [0, 2, 3, 4]


def test_longest_first_and_sorted():
    ids, lengths = random_lengths(3)
    batches = plan_batches(ids, lengths, 8192, 128)
    maxima = [b.max_length for b in batches]
    assert maxima == sorted(maxima, reverse=True)


def test_deterministic_whatever_the_input_order():
    ids, lengths = random_lengths(4)
    perm = np.random.default_rng(9).permutation(len(ids))
    a = plan_batches(ids, lengths, 6000, 100)
    b = plan_batches(ids[perm], lengths[perm], 6000, 100)
    assert a == b
    assert assign_to_ranks(a, 4) == assign_to_ranks(b, 4)


@pytest.mark.parametrize("world_size", [1, 2, 3, 8])
def test_ranks_get_equal_tokens_not_equal_counts(world_size):
    ids, lengths = random_lengths(5, 4000)
    batches = plan_batches(ids, lengths, 8192, 256)
    per_rank = assign_to_ranks(batches, world_size)
    assert sorted(s for rank in per_rank for b in rank for s in b.sample_ids) == sorted(ids.tolist())
    loads = [sum(b.num_padded_tokens for b in rank) for rank in per_rank]
    largest_batch = max(b.num_padded_tokens for b in batches)
    assert max(loads) - min(loads) <= largest_batch
    for rank in per_rank:  # each rank keeps the longest-first order
        maxima = [b.max_length for b in rank]
        assert maxima == sorted(maxima, reverse=True)


def test_token_balance_beats_count_split():
    """A contiguous equal-count split of sorted samples (accelerate's split_between_processes)
    gives one rank all the long samples; the token-balanced plan does not."""
    ids, lengths = random_lengths(6, 4000)
    per_rank = assign_to_ranks(plan_batches(ids, lengths, 8192, 256), 2)
    loads = [sum(b.num_real_tokens for b in rank) for rank in per_rank]
    sorted_lengths = np.sort(lengths)[::-1]
    count_split = [sorted_lengths[:2000].sum(), sorted_lengths[2000:].sum()]
    assert abs(loads[0] - loads[1]) < abs(count_split[0] - count_split[1]) / 10
