"""The confidence intervals of evaluation accuracies against reference values."""

import math

import numpy as np
import pytest

from services.common.confidence import bootstrap_mean_interval, normal_quantile, wilson_interval


@pytest.mark.parametrize("successes, trials, low, high", [
    # Newcombe (1998), "Two-sided confidence intervals for the single proportion", Statistics in
    # Medicine 17:857-872, its examples for method 3 (the score interval without continuity correction).
    (81, 263, 0.2553, 0.3662),
    (15, 148, 0.0624, 0.1605),
    (0, 20, 0.0, 0.1611),
    (1, 29, 0.0061, 0.1718),
    # Symmetry of the last two: n - x successes mirror the interval.
    (20, 20, 1 - 0.1611, 1.0),
    (28, 29, 1 - 0.1718, 1 - 0.0061),
])
def test_wilson_matches_newcombes_published_intervals(successes, trials, low, high):
    got = wilson_interval(successes, trials)
    assert got == pytest.approx((low, high), abs=5e-5)


def test_wilson_keeps_width_at_the_ends_and_narrows_with_more_prompts():
    assert wilson_interval(0, 50) == (0.0, pytest.approx(0.0713, abs=1e-4))  # Wald would give (0, 0)
    assert wilson_interval(50, 50) == (pytest.approx(0.9287, abs=1e-4), 1.0)
    widths = [wilson_interval(n // 2, n)[1] - wilson_interval(n // 2, n)[0] for n in (10, 100, 1000)]
    assert widths[0] > widths[1] > widths[2]
    # Large n: the normal interval p +- z sqrt(p(1-p)/n).
    low, high = wilson_interval(3000, 10000)
    half = 1.959964 * math.sqrt(0.3 * 0.7 / 10000)
    assert (low, high) == pytest.approx((0.3 - half, 0.3 + half), abs=2e-4)
    # 99%: z = 2.5758.
    assert normal_quantile(0.99) == pytest.approx(2.575829, abs=1e-6)
    assert wilson_interval(8, 10, 0.99)[0] < wilson_interval(8, 10)[0]
    for bad in ((5, 4), (-1, 4), (0, 0)):
        with pytest.raises(ValueError):
            wilson_interval(*bad)


def test_bootstrap_on_small_sets_gives_the_exact_bootstrap_quantiles():
    # Two prompts, 0 and 1: resample means are 0, 1/2, 1 with chances 1/4, 1/2, 1/4 -> [0, 1].
    assert bootstrap_mean_interval([0.0, 1.0]) == (0.0, 1.0)
    # [0, 0, 0, 1]: the mean is K/4 with K ~ Binomial(4, 1/4); P(K <= 2) = 0.949 < 0.975 <= P(K <= 3).
    assert bootstrap_mean_interval([0.0, 0.0, 0.0, 1.0]) == (0.0, 0.75)
    # No spread between prompts: the interval is the value itself.
    assert bootstrap_mean_interval([0.25] * 9) == (0.25, 0.25)


def test_bootstrap_agrees_with_the_normal_interval_on_many_prompts_and_is_seeded():
    shares = np.random.default_rng(7).integers(0, 9, size=500) / 8  # 500 prompts, 8 samples each
    mean, sem = shares.mean(), shares.std(ddof=1) / math.sqrt(shares.size)
    low, high = bootstrap_mean_interval(shares)
    assert (low, high) == pytest.approx((mean - 1.959964 * sem, mean + 1.959964 * sem), abs=0.004)
    assert bootstrap_mean_interval(shares) == (low, high)  # same seed, same interval
    assert bootstrap_mean_interval(shares, seed=1) != (low, high)
    assert bootstrap_mean_interval(shares, confidence=0.5)[1] - bootstrap_mean_interval(shares, confidence=0.5)[0] \
        < high - low
    for bad in ([], [[0.5]]):
        with pytest.raises(ValueError):
            bootstrap_mean_interval(bad)
