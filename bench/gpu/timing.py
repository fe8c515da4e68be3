"""Seconds spent in a function, summed over its calls, for the GPU benchmarks' phase tables."""

from __future__ import annotations

import time
from collections.abc import Callable


def timed_into(totals: dict[str, float], name: str, fn: Callable) -> Callable:
    """`fn` wrapped so that every call adds its seconds to totals[name], also when it raises."""
    def call(*args, **kwargs):
        t0 = time.monotonic()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[name] = totals.get(name, 0.0) + time.monotonic() - t0
    return call
