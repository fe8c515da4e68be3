"""Accuracy before and after training on the same held-out problems: how much it moved, and whether
that is more than chance (pure functions, no I/O).

Two answers, both reported by `compare`:

- Each accuracy's Wilson 95% interval (services.common.confidence), and the gain against the sum of
  the two intervals' half-widths. A gain larger than that sum is a conservative criterion: the two
  intervals then do not overlap (for intervals symmetric about the accuracy, exactly so).
- McNemar's exact test, the test for two measurements on the same items: only the problems whose
  verdict changed carry information. Of the `gained` (wrong before, right after) and `lost` (right
  before, wrong after) problems, under "training changed nothing" each changed verdict is a fair coin,
  so gained ~ Binomial(gained + lost, 1/2); the two-sided p-value is twice the smaller tail, capped at 1.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

from services.common.confidence import wilson_interval


@dataclasses.dataclass(frozen=True)
class BeforeAfter:
    """Greedy verdicts of the same problems before and after, summarised."""

    problems: int
    before: float  # accuracy
    after: float
    before_interval: tuple[float, float]  # Wilson, at `confidence`
    after_interval: tuple[float, float]
    gained: int  # problems wrong before and right after
    lost: int  # problems right before and wrong after
    mcnemar_p: float  # exact two-sided p-value of McNemar's test
    confidence: float = 0.95

    @property
    def gain(self) -> float:
        return self.after - self.before

    @property
    def margin(self) -> float:
        """The two intervals' half-widths added: the gain must exceed this."""
        return half_width(self.before_interval) + half_width(self.after_interval)

    @property
    def significant(self) -> bool:
        """The gain is larger than both intervals' half-widths combined."""
        return self.gain > self.margin

    def as_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out.update(gain=self.gain, margin=self.margin, significant=self.significant)
        return out


def half_width(interval: tuple[float, float]) -> float:
    return (interval[1] - interval[0]) / 2


def mcnemar_exact_p(gained: int, lost: int) -> float:
    """Two-sided exact p-value of McNemar's test from the discordant counts: 2 * P(X <= min) for
    X ~ Binomial(gained + lost, 1/2), at most 1 (1 when nothing changed)."""
    if gained < 0 or lost < 0:
        raise ValueError(f"counts must be >= 0, got gained={gained} lost={lost}")
    n = gained + lost
    if n == 0:
        return 1.0
    k = min(gained, lost)
    # Exact in integers: sum of C(n, i) for i <= k over 2^n.
    tail = sum(math.comb(n, i) for i in range(k + 1))
    return min(1.0, 2 * tail / 2 ** n)


def compare(before: Sequence[bool], after: Sequence[bool], confidence: float = 0.95) -> BeforeAfter:
    """BeforeAfter of two verdict lists over the same problems, in the same order."""
    if len(before) != len(after):
        raise ValueError(f"before has {len(before)} verdicts and after {len(after)}: they must be of the same problems")
    if not before:
        raise ValueError("no problems to compare")
    n = len(before)
    right_before, right_after = sum(map(bool, before)), sum(map(bool, after))
    gained = sum(1 for b, a in zip(before, after) if a and not b)
    lost = sum(1 for b, a in zip(before, after) if b and not a)
    return BeforeAfter(problems=n, before=right_before / n, after=right_after / n,
                       before_interval=wilson_interval(right_before, n, confidence),
                       after_interval=wilson_interval(right_after, n, confidence),
                       gained=gained, lost=lost, mcnemar_p=mcnemar_exact_p(gained, lost), confidence=confidence)
