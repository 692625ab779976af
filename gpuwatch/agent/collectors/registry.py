"""The agent's own registry: collectors guarded so one failure never empties a scrape."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

from prometheus_client.core import CollectorRegistry
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import Metric

from gpuwatch.metricspec import Families, MetricSpec

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

    def run(self) -> tuple[list[Metric], list[tuple[str, float, float]]]:
        """Collect everything: the families, and (name, success, seconds) per collector."""
        out: list[Metric] = []
        outcomes: list[tuple[str, float, float]] = []
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
            outcomes.append((collector.name, ok, time.perf_counter() - started))
        return out, outcomes

    def collect(self) -> Iterable[Metric]:
        families, outcomes = self.run()
        own = Families(METRICS)
        for name, ok, seconds in outcomes:
            own.add(SUCCESS, (name,), ok)
            own.add(DURATION, (name,), seconds)
        return families + own.collected()


def build_registry(collectors: Sequence[NamedCollector]) -> CollectorRegistry:
    """A fresh registry (never the global one) holding ``collectors`` behind the guard."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Guarded(collectors))  # type: ignore[arg-type]
    return registry


class _Fixed:
    """A registry-shaped view of families already collected (what the encoders read)."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterable[Metric]:
        return iter(self._families)


class ScrapeRenderer:
    """Renders ``/metrics``, re-encoding what comes from the snapshot once per poll.

    Families derived from the latest snapshot (GPUs, processes, DCGM names) can only
    change when a poll lands, so they are collected and encoded once per snapshot and
    per exposition format; scrapes in between (Prometheus HA pairs, several scrapers, a
    short scrape interval) reuse those bytes. Families that change on their own (the
    agent's counters) and the per-collector success/duration of the render that
    produced the snapshot part are encoded fresh on every scrape.
    """

    def __init__(
        self,
        snapshot_collectors: Sequence[NamedCollector],
        live_collectors: Sequence[NamedCollector],
        *,
        sequence: Callable[[], int | None],
    ) -> None:
        self._snapshot = _Guarded(snapshot_collectors)
        self._live = _Guarded(live_collectors)
        self._sequence = sequence
        self._lock = threading.Lock()
        self._cached_sequence: int | None = None
        self._cached: dict[str, bytes] = {}
        self._cached_families: list[Metric] = []
        self._snapshot_outcomes: list[tuple[str, float, float]] = []

    def render(self, accept: str) -> tuple[bytes, str]:
        """The exposition for an ``Accept`` header: ``(body, content_type)``."""
        encoder, content_type = choose_encoder(accept)
        with self._lock:
            sequence = self._sequence()
            if sequence is None or sequence != self._cached_sequence:
                families, self._snapshot_outcomes = self._snapshot.run()
                self._cached = {}
                self._cached_families = families
                self._cached_sequence = sequence
            snapshot_part = self._cached.get(content_type)
            if snapshot_part is None:
                snapshot_part = encoder(_Fixed(self._cached_families))  # type: ignore[arg-type]
                self._cached[content_type] = snapshot_part
            outcomes = list(self._snapshot_outcomes)
        live, live_outcomes = self._live.run()
        own = Families(METRICS)
        for name, ok, seconds in outcomes + live_outcomes:
            own.add(SUCCESS, (name,), ok)
            own.add(DURATION, (name,), seconds)
        live_part = encoder(_Fixed(live + own.collected()))  # type: ignore[arg-type]
        # OpenMetrics ends each document with "# EOF"; only the last part may keep it.
        return snapshot_part.removesuffix(b"# EOF\n") + live_part, content_type
