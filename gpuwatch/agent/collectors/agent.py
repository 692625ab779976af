"""The agent's own health: build, polls, NVML errors, pushes to the server."""

from __future__ import annotations

import platform
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import get_args

from prometheus_client.metrics_core import Metric

from gpuwatch import __version__
from gpuwatch.agent.state import AgentState
from gpuwatch.metricspec import Families, MetricSpec
from gpuwatch.wire import ItemResult, ReportedKind

# Every value these counters' labels can take, each exported at 0 from the first scrape.
# A series that first appears at its first increment hides that increment from rate()
# and increase(), so an alert on a single burst (one spool overflow) would never fire.
# The values are those the reporter and the spool count under (gpuwatch/agent/reporter.py
# and spool.py); one they report that is missing here is still exported, from its first
# increment. NVML errors are not listed: their (function, error) pairs are too many.
POLL_RESULTS = ("success", "failure")
# What the server says of each snapshot it acknowledged (the wire contract's ItemResult,
# less "deferred": a deferred snapshot is not acknowledged but sent again).
PUSH_RESULTS: tuple[str, ...] = tuple(r for r in get_args(ItemResult) if r != "deferred")
BATCH_RESULTS = (
    "success", "partial", "auth_failed", "too_large", "rejected", "throttled",
    "server_error", "unreachable", "clock_skew", "unexpected_status",
)  # fmt: skip
DROP_REASONS = (
    "spool_full", "corrupt", "rejected", "too_large", "write_failed", "hostname_changed",
)  # fmt: skip
# The events the agent relays (wire.ReportedKind) and why one was never stored
# (gpuwatch/agent/push.py's EventSender).
EVENT_KINDS: tuple[str, ...] = get_args(ReportedKind)
EVENT_DROP_REASONS = ("queue_full", "given_up")

BUILD = MetricSpec(
    "gpuwatch_agent_build",
    "info",
    "Build information of the running agent, and the NVIDIA driver and NVML it reads.",
    ("version", "python_version", "driver_version", "nvml_version"),
)
POLLS = MetricSpec(
    "gpuwatch_agent_polls",
    "counter",
    f"NVML polls by result ({', '.join(POLL_RESULTS)}).",
    ("result",),
)
LAST_POLL = MetricSpec(
    "gpuwatch_agent_last_poll_timestamp_seconds",
    "gauge",
    "When the latest successful poll ran, Unix epoch.",
)
POLL_DURATION = MetricSpec(
    "gpuwatch_agent_poll_duration_seconds", "gauge", "How long the latest poll took."
)
FAKE = MetricSpec(
    "gpuwatch_agent_fake_gpus", "gauge", "1 when the agent runs on simulated GPUs (--fake-gpus)."
)
ISOLATED = MetricSpec(
    "gpuwatch_agent_pid_namespace_isolated", "gauge",
    "1 when the agent cannot see the host PIDs NVML reports (it runs in its own PID namespace).",
)  # fmt: skip
NVML_ERRORS = MetricSpec(
    "gpuwatch_nvml_errors",
    "counter",
    "Per-field NVML failures by function and error.",
    ("function", "error"),
)
TORCH_REPORTS = MetricSpec(
    "gpuwatch_agent_torch_reports", "counter", "Allocator reports received from gpuwatch.torch."
)
PUSHED = MetricSpec(
    "gpuwatch_agent_snapshots_pushed", "counter",
    "Snapshots the server acknowledged, by result (accepted: stored and applied;"
    " duplicate: it had them already; late: stored, but not newer than the host's newest"
    " applied snapshot, so the host's current state did not move).",
    ("result",), availability="server_url set",
)  # fmt: skip
PUSHES = MetricSpec(
    "gpuwatch_agent_push_batches", "counter",
    f"Snapshot batches sent to the server, by result ({', '.join(BATCH_RESULTS)}).",
    ("result",), availability="server_url set",
)  # fmt: skip
DROPPED = MetricSpec(
    "gpuwatch_agent_snapshots_dropped", "counter",
    f"Snapshots dropped before the server stored them, by reason ({', '.join(DROP_REASONS)}).",
    ("reason",), availability="server_url set",
)  # fmt: skip
EVENTS_DROPPED = MetricSpec(
    "gpuwatch_agent_events_dropped", "counter",
    "Events the agent relays (kind: oom incidents, reaped warnings and stops) that the"
    " server never stored, by reason (queue_full: the oldest, past the queue's bound;"
    " given_up: out of tries or refused for good; each is logged with its summary).",
    ("kind", "reason"), availability="server_url set",
)  # fmt: skip
OOM_POSTS_REFUSED = MetricSpec(
    "gpuwatch_agent_oom_posts_refused", "counter",
    "OOM incident posts answered 429 by the per-poster rate limit of the agent's port.",
)  # fmt: skip
PENDING = MetricSpec(
    "gpuwatch_agent_spool_pending", "gauge", "Snapshots waiting in the spool for the server.",
    availability="server_url set",
)  # fmt: skip
LAST_PUSH = MetricSpec(
    "gpuwatch_agent_last_push_success_timestamp_seconds", "gauge",
    "When the server last acknowledged a batch, Unix epoch.", availability="server_url set",
)  # fmt: skip

METRICS = (
    BUILD, POLLS, LAST_POLL, POLL_DURATION, FAKE, ISOLATED, NVML_ERRORS, TORCH_REPORTS,
    PUSHED, PUSHES, DROPPED, EVENTS_DROPPED, OOM_POSTS_REFUSED, PENDING, LAST_PUSH,
)  # fmt: skip


@dataclass(frozen=True)
class PushStats:
    """What the reporter tells the exporter about pushing to the server."""

    batches: dict[str, int] = field(default_factory=dict)
    dropped: dict[str, int] = field(default_factory=dict)
    pending: int = 0
    last_success_time: float | None = None
    pushed: dict[str, int] = field(default_factory=dict)
    events_dropped: dict[tuple[str, str], int] = field(default_factory=dict)


class AgentCollector:
    name = "agent"

    def __init__(
        self,
        state: AgentState,
        *,
        torch_reports_total: Callable[[], int] = lambda: 0,
        push_stats: Callable[[], PushStats] | None = None,
        oom_posts_refused_total: Callable[[], int] = lambda: 0,
    ) -> None:
        self._state = state
        self._torch_total = torch_reports_total
        self._oom_posts_refused = oom_posts_refused_total
        self._push_stats = push_stats

    def collect(self) -> Iterable[Metric]:
        f = Families(METRICS)
        latest = self._state.latest
        f.add_info(
            BUILD,
            (),
            {
                "version": __version__,
                "python_version": platform.python_version(),
                "driver_version": (latest.driver_version if latest else None) or "",
                "nvml_version": (latest.nvml_version if latest else None) or "",
            },
        )
        _add_counts(f, POLLS, POLL_RESULTS, self._state.poll_counts())
        if latest is not None:
            f.add(LAST_POLL, (), latest.collected_at)
            f.add(POLL_DURATION, (), latest.poll_duration_seconds)
            f.add(FAKE, (), 1.0 if latest.fake else 0.0)
            f.add(ISOLATED, (), 1.0 if latest.pid_namespace_isolated else 0.0)
        for (function, error), n in sorted(self._state.nvml_errors.snapshot().items()):
            f.add(NVML_ERRORS, (function, error), n)
        f.add(TORCH_REPORTS, (), self._torch_total())
        f.add(OOM_POSTS_REFUSED, (), self._oom_posts_refused())
        if self._push_stats is not None:
            stats = self._push_stats()
            _add_counts(f, PUSHED, PUSH_RESULTS, stats.pushed)
            _add_counts(f, PUSHES, BATCH_RESULTS, stats.batches)
            _add_counts(f, DROPPED, DROP_REASONS, stats.dropped)
            for kind in EVENT_KINDS:  # 0 until counted, so a rate() sees the first drop
                for reason in EVENT_DROP_REASONS:
                    f.add(
                        EVENTS_DROPPED, (kind, reason), stats.events_dropped.get((kind, reason), 0)
                    )
            f.add(PENDING, (), stats.pending)
            f.add(LAST_PUSH, (), stats.last_success_time)
        return f.collected()


def _add_counts(
    f: Families, spec: MetricSpec, known: tuple[str, ...], counts: dict[str, int]
) -> None:
    """One sample per known label value (0 until counted), then any other counted value."""
    for value in known:
        f.add(spec, (value,), counts.get(value, 0))
    for value, n in sorted(counts.items()):
        if value not in known:
            f.add(spec, (value,), n)
