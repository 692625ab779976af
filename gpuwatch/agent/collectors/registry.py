"""The agent's own registry: collectors guarded so one failure never empties a scrape."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from typing import Protocol

from prometheus_client.core import CollectorRegistry
from prometheus_client.metrics_core import Metric

from gpuwatch.agent.collectors.spec import Families, MetricSpec

log = logging.getLogger(__name__)

SUCCESS = MetricSpec(
    "gpuwatch_scrape_collector_success",
    "gauge",
    "1 if the collector succeeded in this scrape.",
    ("collector",),
)
DURATION = MetricSpec(
    "gpuwatch_scrape_collector_duration_seconds",
    "gauge",
    "How long the collector took in this scrape.",
    ("collector",),
)
METRICS = (SUCCESS, DURATION)


class NamedCollector(Protocol):
    name: str

    def collect(self) -> Iterable[Metric]: ...


class _Guarded:
    """Runs each collector, keeps what succeeded, and reports success and duration."""

    def __init__(self, collectors: Sequence[NamedCollector]) -> None:
        self._collectors = collectors
        self._failing: set[str] = set()

    def collect(self) -> Iterable[Metric]:
        own = Families(METRICS)
        out: list[Metric] = []
        for collector in self._collectors:
            started = time.perf_counter()
            try:
                out.extend(collector.collect())
                ok = 1.0
                self._failing.discard(collector.name)
            except Exception:  # one collector's bug must not empty the whole scrape
                ok = 0.0
                if collector.name not in self._failing:  # log once per failure streak
                    log.exception("collector %s failed", collector.name)
                    self._failing.add(collector.name)
            own.add(SUCCESS, (collector.name,), ok)
            own.add(DURATION, (collector.name,), time.perf_counter() - started)
        return out + own.collected()


def build_registry(collectors: Sequence[NamedCollector]) -> CollectorRegistry:
    """A fresh registry (never the global one) holding ``collectors`` behind the guard."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Guarded(collectors))  # type: ignore[arg-type]
    return registry
