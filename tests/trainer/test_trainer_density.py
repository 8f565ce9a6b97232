"""Step 3's adaptive density: slower links compress harder, within bounds, no drift."""

from __future__ import annotations

import pytest

from trainer.algorithm import adapt_densities

KW = dict(target=0.01, low=0.002, high=0.05, gamma=0.5)


def test_slower_transmission_lowers_density_and_faster_raises_it():
    new = adapt_densities([0.01] * 4, [0.1, 0.1, 0.4, 0.4], **KW)
    assert new[0] > 0.01 and new[1] > 0.01
    assert new[2] < 0.01 and new[3] < 0.01
    assert new[0] == new[1] and new[2] == new[3]


def test_equal_transmission_times_keep_the_densities():
    assert adapt_densities([0.01] * 3, [0.2, 0.2, 0.2], **KW) == pytest.approx([0.01] * 3, rel=1e-12)


def test_densities_stay_within_bounds():
    d = [0.01, 0.01]
    for _ in range(50):
        d = adapt_densities(d, [1e-4, 10.0], **KW)
    assert d[0] == KW["high"] and d[1] == KW["low"]


def test_repeated_adaptation_converges_to_density_proportional_to_bandwidth():
    bandwidth = [4.0, 1.0]
    d = [0.01, 0.01]
    for _ in range(60):
        times = [di / b for di, b in zip(d, bandwidth)]  # time = bytes / bandwidth
        d = adapt_densities(d, times, target=0.01, low=1e-4, high=0.5, gamma=0.5)
    assert abs(d[0] / d[1] - 4.0) < 0.01


def test_missing_times_leave_densities_unchanged():
    assert adapt_densities([0.02, 0.005], [0.0, 0.3], **KW) == [0.02, 0.005]


def test_times_below_the_floor_count_as_equal():
    # Loopback jitter of a few milliseconds is not a slower link.
    assert adapt_densities([0.01] * 3, [0.0004, 0.009, 0.02], floor=0.05, **KW) == pytest.approx([0.01] * 3)


def test_a_slow_link_above_the_floor_still_compresses_harder():
    new = adapt_densities([0.01] * 3, [0.001, 0.002, 0.4], floor=0.05, **KW)
    assert new[0] == new[1] > 0.01 > new[2]
