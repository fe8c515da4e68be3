"""The reward service's extra metrics of one step, as `reward/<name>` means.

Two kinds arrive with each Score answer: per-sample values (the math rule's accuracy, a server's
"extra_logs" lists), kept in each sample's `extra`, and batch metrics, which a reward function or
server gave once for a whole call (OpenRLHF's math reward file returns its batch's accuracy as one
number), kept as (value x samples, samples) on the first sample of the call. A batch metric is never
copied onto the samples: weighted by its calls' samples, the step's mean of a batch accuracy is the
accuracy over the step's samples. A name given both ways in one step is averaged over all of them.
"""

from __future__ import annotations

import math


def reward_metrics(samples) -> dict[str, float]:
    """{"reward/<name>": mean} over the samples' `extra` values and their calls' `score_batch_metrics`."""
    sums: dict[str, list[float]] = {}
    for sample in samples:
        for name, (weighted_sum, count) in sample.score_batch_metrics.items():
            total = sums.setdefault(name, [0.0, 0])
            total[0] += weighted_sum
            total[1] += count
        for name, value in sample.extra.items():
            if math.isfinite(value):  # NaN where a chunk of the answer lacked the metric
                total = sums.setdefault(name, [0.0, 0])
                total[0] += value
                total[1] += 1
    return {f"reward/{name}": total / count for name, (total, count) in sorted(sums.items()) if count}
