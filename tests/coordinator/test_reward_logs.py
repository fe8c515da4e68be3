"""A step's reward metrics: per-sample extras and per-call batch metrics, neither copied onto the other."""

import math
from types import SimpleNamespace

import pytest

from services.coordinator.loop.reward_logs import reward_metrics


def sample(extra=None, batch=None):
    return SimpleNamespace(extra=extra or {}, score_batch_metrics=batch or {})


def test_batch_metrics_are_weighted_by_their_calls_and_never_per_sample():
    # Two Score calls, of 3 and 2 samples, with accuracies 2/3 and 1/2 (sums 2 and 1), held by their first samples.
    samples = [sample({"length": 3.0}, {"math_accuracy": (2.0, 3)}), sample({"length": 5.0}),
               sample({"length": math.nan}), sample({}, {"math_accuracy": (1.0, 2)}), sample({"length": 1.0})]
    assert reward_metrics(samples) == {"reward/math_accuracy": pytest.approx(0.6), "reward/length": pytest.approx(3.0)}
    # A name given both ways is averaged over all of its samples.
    samples[1].score_batch_metrics = {"length": (10.0, 2)}
    assert reward_metrics(samples)["reward/length"] == pytest.approx((3 + 5 + 1 + 10) / 5)
    assert reward_metrics([]) == {}
