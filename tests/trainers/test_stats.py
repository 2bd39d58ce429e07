"""The leaderboard's statistics against values computed by hand."""

import math

import pytest

from trainers.stats import bootstrap_interval, mean, pass_at_k, wilson_interval


def test_wilson_interval_of_8_in_10_matches_the_hand_computed_bounds():
    # p = 0.8, z^2 = 3.8415; centre (0.8 + 0.19208) / 1.38415 = 0.71674,
    # half-width 1.95996 * sqrt(0.016 + 0.0096040) / 1.38415 = 0.22658.
    low, high = wilson_interval(8, 10)
    assert low == pytest.approx(0.49016, abs=1e-4)
    assert high == pytest.approx(0.94332, abs=1e-4)


def test_wilson_interval_at_zero_and_all_successes_is_not_degenerate():
    # With no successes, centre = half-width = 0.19208 / 1.38415 = 0.13877.
    assert wilson_interval(0, 10) == pytest.approx((0.0, 0.27754), abs=1e-4)
    assert wilson_interval(10, 10) == pytest.approx((0.72246, 1.0), abs=1e-4)
    assert wilson_interval(0, 0) == (0.0, 1.0)


def test_wilson_interval_rejects_impossible_counts():
    with pytest.raises(ValueError, match="successes"):
        wilson_interval(11, 10)


def test_bootstrap_of_two_values_spans_both():
    # A resample of [0, 1] has mean 0 (p 1/4), 0.5 (1/2) or 1 (1/4): the 2.5% and 97.5%
    # quantiles of the resampled means are 0 and 1.
    assert bootstrap_interval([0.0, 1.0], resamples=4000) == (0.0, 1.0)


def test_bootstrap_of_constant_values_is_a_point_and_is_reproducible():
    assert bootstrap_interval([0.5, 0.5, 0.5]) == (0.5, 0.5)
    values = [0.0, 1.0, 1.0, 0.0, 1.0, 0.25]
    assert bootstrap_interval(values, seed=3) == bootstrap_interval(values, seed=3)
    low, high = bootstrap_interval(values)
    assert low < mean(values) < high


def test_bootstrap_and_mean_of_nothing_are_nan():
    assert all(math.isnan(v) for v in bootstrap_interval([]))
    assert math.isnan(mean([]))


def test_pass_at_k_matches_the_combinatorial_formula():
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4)
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # 1 - C(3,2) / C(5,2)
    assert pass_at_k(5, 2, 4) == 1.0  # fewer than 4 failures: any 4 draws include a pass
    assert pass_at_k(5, 0, 5) == 0.0
    with pytest.raises(ValueError):
        pass_at_k(3, 1, 4)
