"""Step 1: batch sizes proportional to speed, summing exactly to B, each at least 1; evaluation
slices follow the same shares."""

from __future__ import annotations

import random

import pytest

from trainer.allocation import (
    aggregation_weights,
    equal_batch_sizes,
    proportional_batch_sizes,
    rebalance,
    soonest_finish,
)
from trainer.loader import eval_slice


def test_batch_sizes_sum_exactly_to_global_batch_with_every_share_at_least_one():
    rng = random.Random(0)
    for _ in range(2000):
        m = rng.randint(1, 12)
        b = rng.randint(m, 1024)
        speeds = [rng.choice([rng.uniform(1e-4, 1), rng.uniform(1, 1e4)]) for _ in range(m)]
        sizes = proportional_batch_sizes(b, speeds)
        assert sum(sizes) == b and min(sizes) >= 1 and len(sizes) == m


def test_batch_sizes_follow_speeds_within_one_sample():
    speeds = [1, 0.89, 0.39, 0.39]
    sizes = proportional_batch_sizes(256, speeds)
    assert sizes == [95, 85, 38, 38]
    for n, s in zip(sizes, speeds):
        assert abs(n - 256 * s / sum(speeds)) < 1.0 + 1e-9


def test_a_very_slow_worker_still_gets_one_sample():
    assert proportional_batch_sizes(8, [1000, 1000, 1e-6]) == [4, 3, 1]


def test_equal_allocation_differs_by_at_most_one():
    sizes = equal_batch_sizes(10, 4)
    assert sum(sizes) == 10 and max(sizes) - min(sizes) == 1


def test_allocation_rejects_impossible_requests():
    with pytest.raises(ValueError):
        proportional_batch_sizes(3, [1, 1, 1, 1])
    with pytest.raises(ValueError):
        proportional_batch_sizes(16, [1, 0])


def test_aggregation_weights_are_batch_shares():
    assert aggregation_weights([96, 85, 38, 37]) == [96 / 256, 85 / 256, 38 / 256, 37 / 256]


def test_measured_rebalance_moves_samples_to_the_faster_worker():
    # Equal batches, but worker 0 computes its batch in half the time: 43 / 320 samples/s is
    # 0.134 s, where the nearest shares, 42 and 22, would leave worker 1 at 22 / 160 = 0.1375 s.
    assert rebalance(64, [32, 32], [0.1, 0.2]) == [43, 21]


def test_rebalance_evens_out_finishing_times_including_a_fixed_per_step_cost():
    # Same speed (320 samples/s), but worker 1 spends 50 ms more per step compressing.
    sizes = rebalance(64, [32, 32], [0.1, 0.1], [0.0, 0.05])
    assert sizes == [40, 24]
    assert 40 / 320 == 24 / 320 + 0.05


def test_rebalance_with_equal_overheads_is_the_compute_only_split():
    assert rebalance(64, [32, 32], [0.1, 0.2], [0.03, 0.03]) == rebalance(64, [32, 32], [0.1, 0.2]) == [43, 21]


def test_the_whole_samples_are_those_whose_slowest_worker_finishes_first_not_the_nearest_shares():
    # charlm's round under sites as replicas: two on-prem workers, two cloud workers of 3.6
    # samples a round-second whose site averages 0.17 s a round longer. Their exact shares are
    # 7.4 each; an eighth sample is 0.28 s more for the cloud, a 27th or 23rd 0.09 s on-prem.
    sizes = rebalance(64, [25, 23, 8, 8], [25 / 11.72, 23 / 10.25, 8 / 3.61, 8 / 3.58], [0.3, 0.3, 0.47, 0.47])
    assert sizes == [27, 23, 7, 7]
    assert proportional_batch_sizes(64, [26.2, 22.9, 7.45, 7.39]) == [26, 22, 8, 8]  # the nearest


def test_the_soonest_finish_starts_from_a_split_of_the_whole_batch():
    with pytest.raises(ValueError, match="start"):
        soonest_finish(64, [1.0, 1.0], [0.0, 0.0], start=[32, 31])


def test_a_worker_whose_overhead_exceeds_the_step_keeps_one_sample():
    assert rebalance(64, [32, 32], [0.1, 0.1], [0.0, 5.0]) == [63, 1]


def test_evaluation_slices_tile_the_held_out_set_in_proportion_to_batch_shares():
    batches = (40, 36, 16, 16)
    parts = [eval_slice(360, w, batches) for w in range(4)]
    assert parts[0].start == 0 and parts[-1].stop == 360
    assert all(a.stop == b.start for a, b in zip(parts, parts[1:]))
    assert [p.stop - p.start for p in parts] == [133, 120, 54, 53]


def test_equal_batches_score_equal_evaluation_slices():
    assert [eval_slice(360, w, (64,) * 4).stop for w in range(4)] == [90, 180, 270, 360]


def test_a_rank_not_in_the_run_scores_no_evaluation_slice():
    assert eval_slice(360, 1, (10, 0, 20)) == slice(120, 120)
    assert eval_slice(360, 2, (10, 0, 20)) == slice(120, 360)


def test_evaluation_slices_reject_a_split_without_samples():
    with pytest.raises(ValueError, match="positive sum"):
        eval_slice(360, 0, (0, 0))
