"""Confidence intervals of evaluation accuracies (pure functions, no I/O).

Two cases, both with the prompts as the sampled units (a held-out set is a sample of the prompts the
task could have had; the interval says how far the accuracy could move on another such sample):

- One verdict per prompt (greedy decoding, or one sample): the accuracy is a binomial proportion,
  and `wilson_interval` is the Wilson score interval. Unlike the normal (Wald) interval it stays
  inside [0, 1] and keeps its width at 0 and 100 % correct (0 of 50 right: 0 to 7.1 %).
- Several samples per prompt (pass@1 as the mean of each prompt's share of correct samples): the
  samples of one prompt are not independent, so a binomial interval over all samples would be too
  narrow. `bootstrap_mean_interval` is the percentile bootstrap of the mean of the per-prompt
  shares: prompts are resampled with replacement, each keeping its own samples, with a fixed seed
  (the same numbers give the same interval). When every prompt has the same share (all 0 or all 1)
  the interval is that single value: the data show no spread to resample.
"""

from __future__ import annotations

import math
from statistics import NormalDist
from typing import Sequence

import numpy as np

BOOTSTRAP_RESAMPLES = 10_000
BOOTSTRAP_SEED = 0
_CELLS_PER_CHUNK = 1 << 22  # resamples x prompts drawn at once (32 MiB of int64 indices)


def normal_quantile(confidence: float) -> float:
    """z of a two-sided interval: 1.959964 for 0.95."""
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    return NormalDist().inv_cdf(0.5 + confidence / 2)


def wilson_interval(successes: int, trials: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval of a proportion successes / trials (Wilson 1927; Newcombe 1998, method 3).

    centre = (p + z^2 / 2n) / (1 + z^2 / n), half-width = z / (1 + z^2 / n) * sqrt(p(1-p)/n + z^2 / 4n^2).
    """
    if trials < 1 or not 0 <= successes <= trials:
        raise ValueError(f"need 0 <= successes <= trials and trials >= 1, got {successes} of {trials}")
    z = normal_quantile(confidence)
    p, n = successes / trials, trials
    denominator = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denominator
    half = z / denominator * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    # At p = 0 or 1 the bound equals p up to rounding: return p itself there.
    low = 0.0 if successes == 0 else max(0.0, centre - half)
    high = 1.0 if successes == trials else min(1.0, centre + half)
    return low, high


def bootstrap_mean_interval(values: Sequence[float], confidence: float = 0.95, resamples: int = BOOTSTRAP_RESAMPLES,
                            seed: int = BOOTSTRAP_SEED) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of values (one value per prompt).

    values: (prompts,). Each of `resamples` resamples draws len(values) prompts with replacement; the
    interval runs between the (1 - confidence) / 2 and (1 + confidence) / 2 quantiles of their means.
    """
    data = np.asarray(values, dtype=np.float64)
    if data.ndim != 1 or data.size == 0:
        raise ValueError(f"need a non-empty 1-D sequence of values, got shape {data.shape}")
    if resamples < 1:
        raise ValueError(f"resamples must be >= 1, got {resamples}")
    normal_quantile(confidence)  # checks confidence
    rng = np.random.default_rng(seed)
    means = np.empty(resamples)
    chunk = max(1, _CELLS_PER_CHUNK // data.size)
    for start in range(0, resamples, chunk):
        rows = min(chunk, resamples - start)
        means[start:start + rows] = data[rng.integers(0, data.size, size=(rows, data.size))].mean(axis=1)
    tail = (1 - confidence) / 2
    low, high = np.quantile(means, [tail, 1 - tail])
    return float(low), float(high)
