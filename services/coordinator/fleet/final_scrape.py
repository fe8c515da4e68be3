"""The run's last metrics reach Prometheus before the coordinator exits.

Prometheus pulls: a short run whose process ends right after its last step would take that step's
numbers with it (the next scrape finds nothing). The coordinator therefore notes every scrape of
its metrics port (each one collects the registry, which calls `ScrapeWatch.collect`) and, at the
end of a run that was being scraped, keeps serving until one more scrape has happened, bounded by
--metrics_final_scrape_timeout_s. A run nobody scrapes (the local default) does not wait.
"""

from __future__ import annotations

import asyncio
import threading
import time

import prometheus_client
from prometheus_client.core import GaugeMetricFamily

from services.common.log import get_logger, log_event

_log = get_logger("coordinator")


class ScrapeWatch:
    """A collector in the default registry that records when the registry was last collected."""

    def __init__(self, registry=prometheus_client.REGISTRY):
        self._lock = threading.Lock()
        self.scrapes = 0
        self.last_scrape = 0.0  # time.monotonic() of the latest scrape; 0 = none yet
        self._registry = registry
        registry.register(self)

    def describe(self):
        # Declared without collecting, so registering is not counted as a scrape.
        return [GaugeMetricFamily("rlmesh_coordinator_scrapes", "scrapes of this coordinator's metrics so far")]

    def collect(self):
        with self._lock:
            self.scrapes += 1
            self.last_scrape = time.monotonic()
            count = self.scrapes
        yield GaugeMetricFamily("rlmesh_coordinator_scrapes", "scrapes of this coordinator's metrics so far",
                                value=count)

    def close(self) -> None:
        self._registry.unregister(self)

    async def wait_for_scrape_after(self, since: float, timeout_s: float, poll_s: float = 0.2) -> bool:
        """Waits until a scrape later than `since` (time.monotonic()); True when one came.

        Returns at once (False) when nothing has scraped this run at all, or timeout_s <= 0.
        """
        if self.scrapes == 0 or timeout_s <= 0:
            return False
        deadline = since + timeout_s
        log_event(_log, "metrics.final_scrape_wait", timeout_s=timeout_s)
        while time.monotonic() < deadline:
            if self.last_scrape > since:
                log_event(_log, "metrics.final_scrape", waited_s=round(time.monotonic() - since, 2))
                return True
            await asyncio.sleep(poll_s)
        log_event(_log, "metrics.final_scrape_missed", level=30, timeout_s=timeout_s)
        return False
