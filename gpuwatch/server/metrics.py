"""The server's ``/metrics``: fleet state from the database, plus this process's counters.

Fleet families (``gpuwatch_fleet_*``) are built at scrape time by bounded queries
(grouped by kind, host or bucket, so their size follows the fleet, not history) on a
registry the app owns. Server families (``gpuwatch_server_*``) are counters of this
process (one replica's view; Prometheus sums them across replicas). A database outage
does not fail the scrape: ``gpuwatch_server_database_up`` drops to 0 and the fleet
families are absent rather than stale.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from sqlalchemy import case, func, select
from sqlalchemy.exc import SQLAlchemyError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gpuwatch.server.database.core import Database, describe
from gpuwatch.server.events.models import Event
from gpuwatch.server.fleet.service import gpus_by_fullness
from gpuwatch.server.hosts.models import Host
from gpuwatch.server.hosts.service import silence_threshold_seconds
from gpuwatch.settings import ServerSettings

log = logging.getLogger(__name__)

INGEST_PATH = "/api/v1/snapshots"
_RESULT_BY_STATUS = {
    200: "ok",
    400: "invalid",
    401: "unauthorized",
    403: "forbidden",
    413: "too_large",
    422: "invalid",
    503: "unavailable",
}


class ServerStats:
    """Thread-safe counters of this process (requests run in a thread pool)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.ingest_requests: Counter[str] = Counter()
        self.ingest_snapshots: Counter[str] = Counter()
        self.events_opened: Counter[str] = Counter()
        self.job_runs: Counter[tuple[str, str]] = Counter()

    def count(self, counter: Counter[Any], key: Any, n: int = 1) -> None:
        with self._lock:
            counter[key] += n

    def snapshot(self) -> dict[str, dict[Any, int]]:
        with self._lock:
            return {
                "ingest_requests": dict(self.ingest_requests),
                "ingest_snapshots": dict(self.ingest_snapshots),
                "events_opened": dict(self.events_opened),
                "job_runs": dict(self.job_runs),
            }


class IngestStatusMiddleware:
    """Counts ingest requests by outcome, including the 413s and 422s answered before
    the handler runs."""

    def __init__(self, app: ASGIApp, stats: ServerStats) -> None:
        self.app = app
        self.stats = stats

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] != INGEST_PATH or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                result = _RESULT_BY_STATUS.get(message["status"], "error")
                self.stats.count(self.stats.ingest_requests, result)
            await send(message)

        await self.app(scope, receive, counting_send)


class FleetCollector(Collector):
    """Builds every family afresh on each scrape."""

    def __init__(
        self,
        *,
        database: Database,
        settings: ServerSettings,
        stats: ServerStats,
        clock: Callable[[], float],
    ) -> None:
        self.database = database
        self.settings = settings
        self.stats = stats
        self.clock = clock

    def collect(self) -> Iterator[Metric]:
        started = time.perf_counter()
        yield from self._server_families()
        up = GaugeMetricFamily(
            "gpuwatch_server_database_up", "1 when the last scrape could read the database."
        )
        try:
            fleet = list(self._fleet_families())
        except SQLAlchemyError as err:
            log.warning("metrics: cannot read the database: %s", describe(err))
            up.add_metric([], 0)
        else:
            up.add_metric([], 1)
            yield from fleet
        yield up
        duration = GaugeMetricFamily(
            "gpuwatch_server_scrape_duration_seconds", "Time this scrape took to build."
        )
        duration.add_metric([], time.perf_counter() - started)
        yield duration

    def _server_families(self) -> Iterator[Metric]:
        counts = self.stats.snapshot()
        requests = CounterMetricFamily(
            "gpuwatch_server_ingest_requests",
            "Snapshot push requests answered, by result.",
            labels=["result"],
        )
        for result, n in sorted(counts["ingest_requests"].items()):
            requests.add_metric([result], n)
        snapshots = CounterMetricFamily(
            "gpuwatch_server_ingest_snapshots",
            "Snapshots in accepted requests: accepted (stored) or duplicate (a retry).",
            labels=["result"],
        )
        for result in ("accepted", "duplicate"):
            snapshots.add_metric([result], counts["ingest_snapshots"].get(result, 0))
        opened = CounterMetricFamily(
            "gpuwatch_server_events_opened", "Events this process opened, by kind.", labels=["kind"]
        )
        for kind, n in sorted(counts["events_opened"].items()):
            opened.add_metric([kind], n)
        jobs = CounterMetricFamily(
            "gpuwatch_server_job_runs",
            "Scheduled job runs, by job and result (ok, failed, skipped: another replica).",
            labels=["job", "result"],
        )
        for (job, result), n in sorted(counts["job_runs"].items()):
            jobs.add_metric([job, result], n)
        yield from (requests, snapshots, opened, jobs)

    def _fleet_families(self) -> Iterator[Metric]:
        now = self.clock()
        silent_before = now - silence_threshold_seconds(self.settings)
        with self.database.reader() as session:
            fullness = gpus_by_fullness(session=session, settings=self.settings, now=now)
            open_by_kind = session.execute(
                select(Event.kind, func.count(Event.id))
                .where(Event.ended_at.is_(None))
                .group_by(Event.kind)
            ).all()
            held = session.execute(
                select(Host.hostname, Event.kind, func.sum(Event.held_bytes))
                .join(Host, Host.id == Event.host_id)
                .where(Event.ended_at.is_(None), Event.kind.in_(("orphaned", "idle")))
                .group_by(Host.hostname, Event.kind)
            ).all()
            hosts = session.execute(
                select(
                    Host.hostname,
                    Host.spool_dropped_total,
                    case(
                        (Host.last_received_at.is_(None), 1),
                        (Host.last_received_at < silent_before, 1),
                        else_=0,
                    ),
                )
            ).all()
        open_events = GaugeMetricFamily(
            "gpuwatch_fleet_open_events", "Events open now, by kind.", labels=["kind"]
        )
        for kind, n in sorted(open_by_kind):
            open_events.add_metric([kind], n)
        orphaned = GaugeMetricFamily(
            "gpuwatch_fleet_orphaned_memory_bytes",
            "GPU memory held by orphaned holders (open orphaned events), by host.",
            labels=["host"],
        )
        idle = GaugeMetricFamily(
            "gpuwatch_fleet_idle_memory_bytes",
            "GPU memory held by idle holders (open idle events), by host.",
            labels=["host"],
        )
        for hostname, kind, total in sorted(held):
            (orphaned if kind == "orphaned" else idle).add_metric([hostname], total or 0)
        dropped = CounterMetricFamily(
            "gpuwatch_fleet_agent_spool_dropped",
            "Snapshots each host's agent reported dropping from its spool.",
            labels=["host"],
        )
        silent = GaugeMetricFamily(
            "gpuwatch_fleet_agent_silent",
            "1 when the host's agent has not pushed for agent_silent_intervals intervals.",
            labels=["host"],
        )
        for hostname, spool_dropped, is_silent in sorted(hosts):
            dropped.add_metric([hostname], spool_dropped)
            silent.add_metric([hostname], is_silent)
        gpus = GaugeMetricFamily(
            "gpuwatch_fleet_gpus",
            "GPUs by memory fullness (used/total); 'unknown' for lost, unread or stale.",
            labels=["fullness"],
        )
        for bucket, count in fullness.items():
            gpus.add_metric([bucket], count)
        yield from (open_events, orphaned, idle, dropped, silent, gpus)


def build_registry(
    *,
    database: Database,
    settings: ServerSettings,
    stats: ServerStats,
    clock: Callable[[], float],
) -> CollectorRegistry:
    """A registry of the app's own (never the process-global ``REGISTRY``)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(
        FleetCollector(database=database, settings=settings, stats=stats, clock=clock)
    )
    return registry
