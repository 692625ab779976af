"""The reaper's automatic policy: warnings, withdrawals, stops and refusals.

Exported only while ``[agent.reap] enabled`` is set (docs/reaper.md); every label value
is there from the first scrape, at 0, so ``increase()`` sees the first warning or stop.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client.metrics_core import Metric

from gpuwatch.agent.collectors.agent import _add_counts
from gpuwatch.agent.reaper.stats import (
    REFUSAL_REASONS,
    STOP_OUTCOMES,
    WITHDRAWN_REASONS,
    PolicyCounts,
)
from gpuwatch.metricspec import Families, MetricSpec

ENABLED = "`[agent.reap] enabled`"

WARNINGS = MetricSpec(
    "gpuwatch_reaper_warnings",
    "counter",
    "Warnings the policy issued: a process will be stopped unless it becomes active.",
    availability=ENABLED,
)
WITHDRAWN = MetricSpec(
    "gpuwatch_reaper_warnings_withdrawn",
    "counter",
    f"Warnings withdrawn, by reason ({', '.join(WITHDRAWN_REASONS)}).",
    ("reason",),
    availability=ENABLED,
)
STOPS = MetricSpec(
    "gpuwatch_reaper_stops",
    "counter",
    f"Processes the policy stopped or tried to, by outcome ({', '.join(STOP_OUTCOMES)}).",
    ("outcome",),
    availability=ENABLED,
)
REFUSALS = MetricSpec(
    "gpuwatch_reaper_refusals",
    "counter",
    f"Times the policy did not act, by reason ({', '.join(REFUSAL_REASONS)}).",
    ("reason",),
    availability=ENABLED,
)
WARNED = MetricSpec(
    "gpuwatch_reaper_warned_processes",
    "gauge",
    "Processes under a warning now (to be stopped unless they become active).",
    availability=ENABLED,
)

METRICS = (WARNINGS, WITHDRAWN, STOPS, REFUSALS, WARNED)


class ReaperCollector:
    """Reads the policy's counters at scrape time; ``source`` returns ``None`` when the
    policy is off, and then nothing is exported."""

    name = "reaper"

    def __init__(self, source: Callable[[], PolicyCounts | None]) -> None:
        self._source = source

    def collect(self) -> Iterable[Metric]:
        counts = self._source()
        if counts is None:
            return []
        f = Families(METRICS)
        f.add(WARNINGS, (), counts.warnings)
        _add_counts(f, WITHDRAWN, WITHDRAWN_REASONS, counts.withdrawn)
        _add_counts(f, STOPS, STOP_OUTCOMES, counts.stops)
        _add_counts(f, REFUSALS, REFUSAL_REASONS, counts.refusals)
        f.add(WARNED, (), counts.warned_now)
        return f.collected()
