"""The server's ``/metrics``: fleet state from the database, plus this process's counters.

Fleet families (``gpuwatch_fleet_*``) are built at scrape time by bounded queries
(grouped by kind, host or bucket, so their size follows the fleet, not history) on a
registry the app owns. Server families (``gpuwatch_server_*``) are counters of this
process (one replica's view; Prometheus sums them across replicas). A database outage
does not fail the scrape: ``gpuwatch_server_database_up`` drops to 0 and the fleet
families are absent rather than stale. A database that can be read but not written
(after a write failed so) is down too, though its fleet families are still exported.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric
from prometheus_client.registry import Collector
from sqlalchemy import case, func, select
from sqlalchemy.exc import SQLAlchemyError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gpuwatch.metricspec import MetricSpec
from gpuwatch.server.database.core import Database, describe
from gpuwatch.server.events.models import EVENT_KINDS, Event
from gpuwatch.server.fleet.service import gpus_by_fullness
from gpuwatch.server.hosts.models import Host
from gpuwatch.server.hosts.service import silent_before
from gpuwatch.settings import ServerSettings

log = logging.getLogger(__name__)

SERVER_DATABASE_UP = MetricSpec(
    "gpuwatch_server_database_up",
    "gauge",
    "1 when the last scrape could read the database and it takes writes (0 from a write"
    " that failed for want of a writable database, read-only or full, until one succeeds;"
    " the scrape tries one then).",
    (),
)
SERVER_SCRAPE_DURATION_SECONDS = MetricSpec(
    "gpuwatch_server_scrape_duration_seconds", "gauge", "Time this scrape took to build.", ()
)
SERVER_INGEST_REQUESTS = MetricSpec(
    "gpuwatch_server_ingest_requests",
    "counter",
    "Snapshot push requests answered, by result (partial: some snapshots deferred;"
    " over_budget: 503, its time budget spent before its turn; slow_body: 503, its body"
    " still arriving when the budget ran out; host_busy: 429, two of the host's requests"
    " already being read, or the host's share of ingest work used).",
    ("result",),
)
SERVER_INGEST_SNAPSHOTS = MetricSpec(
    "gpuwatch_server_ingest_snapshots",
    "counter",
    "Snapshots in accepted requests: accepted (stored), duplicate (a retry) or deferred"
    " (not stored: the request's time budget ran out; the agent sends it again).",
    ("result",),
)
SERVER_CLOCK_STEPPED_SNAPSHOTS = MetricSpec(
    "gpuwatch_server_clock_stepped_snapshots",
    "counter",
    "Snapshots applied at the server's receive time because their agent's clock had"
    " stepped back (same boot, a higher sequence, an earlier time): fix that host's time"
    " sync.",
    (),
)
SERVER_FUTURE_SNAPSHOT_PUSHES = MetricSpec(
    "gpuwatch_server_future_snapshot_pushes",
    "counter",
    "Snapshot pushes refused (422 clock_skew) because a snapshot was collected more than"
    " 600 s ahead of this server's clock: that host's clock runs ahead, or this server's"
    " behind (see gpuwatch_server_hosts_ahead_of_clock).",
    (),
)
SERVER_HOSTS_AHEAD_OF_CLOCK = MetricSpec(
    "gpuwatch_server_hosts_ahead_of_clock",
    "gauge",
    "Hosts whose pushes this process refused as from its future in the last 10 minutes;"
    " several at once point at this server's clock running behind.",
    (),
)
SERVER_AGENT_ID_FLAPS = MetricSpec(
    "gpuwatch_server_agent_id_flaps",
    "counter",
    "Pushes whose agent_id switched back to the one the host had before the current one:"
    " two agents report one host name (a cloned VM or a copied config).",
    (),
)
SERVER_EVENTS_OPENED = MetricSpec(
    "gpuwatch_server_events_opened", "counter", "Events this process opened, by kind.", ("kind",)
)
SERVER_JOB_RUNS = MetricSpec(
    "gpuwatch_server_job_runs",
    "counter",
    "Scheduled job runs, by job and result (ok, failed, skipped: another replica held"
    " the job's lock, busy: not started because the job's previous run was still going,"
    " as when the alert job takes longer than evaluation_interval).",
    # Not "job": Prometheus sets that target label on every series it scrapes (it
    # would arrive as "exported_job", and `by (job)` lump every scheduled job together).
    ("scheduled_job", "result"),
)
SERVER_NOTIFICATIONS = MetricSpec(
    "gpuwatch_server_notifications",
    "counter",
    "Notification delivery attempts by receiver and outcome: sent, retry (a transient"
    " failure, tried again later: 408, 425, 429, 5xx, a timeout or a connection error),"
    " broken (refused for good: a 3xx, any other 4xx, a request that cannot be made such"
    " as an invalid URL, or a Slack answer other than ok), failed (given up at the"
    " delivery deadline).",
    ("receiver", "outcome"),
)
SERVER_WRITE_TURN_WAIT_SECONDS = MetricSpec(
    "gpuwatch_server_write_turn_wait_seconds",
    "counter",
    "Time this process's writers waited for their turn at SQLite's one write lock; its"
    " rate is how many wait on average.",
    (),
    availability="SQLite (Postgres writers do not take turns)",
)
SERVER_WRITE_TURN_HELD_SECONDS = MetricSpec(
    "gpuwatch_server_write_turn_held_seconds",
    "counter",
    "Time this process's writers held SQLite's one write lock; its rate is the share of"
    " time the database's writer is busy, and near 1 ingest is at this machine's capacity.",
    (),
    availability="SQLite (Postgres writers do not take turns)",
)
FLEET_OPEN_EVENTS = MetricSpec(
    "gpuwatch_fleet_open_events", "gauge", "Events open now, by kind.", ("kind",)
)
FLEET_ORPHANED_MEMORY_BYTES = MetricSpec(
    "gpuwatch_fleet_orphaned_memory_bytes",
    "gauge",
    "GPU memory held by orphaned holders (open orphaned events), by host.",
    ("host",),
)
FLEET_IDLE_MEMORY_BYTES = MetricSpec(
    "gpuwatch_fleet_idle_memory_bytes",
    "gauge",
    "GPU memory held by idle holders (open idle events), by host.",
    ("host",),
)
FLEET_AGENT_SPOOL_DROPPED = MetricSpec(
    "gpuwatch_fleet_agent_spool_dropped",
    "counter",
    "Snapshots each host's agent reported dropping from its spool.",
    ("host",),
)
FLEET_AGENT_SILENT = MetricSpec(
    "gpuwatch_fleet_agent_silent",
    "gauge",
    "1 when the host's agent has not pushed for agent_silent_intervals intervals.",
    ("host",),
)
FLEET_GPUS = MetricSpec(
    "gpuwatch_fleet_gpus",
    "gauge",
    "GPUs by memory fullness (used/total); 'unknown' for lost, unread or stale.",
    ("fullness",),
)

METRICS = (
    SERVER_DATABASE_UP,
    SERVER_SCRAPE_DURATION_SECONDS,
    SERVER_INGEST_REQUESTS,
    SERVER_INGEST_SNAPSHOTS,
    SERVER_CLOCK_STEPPED_SNAPSHOTS,
    SERVER_FUTURE_SNAPSHOT_PUSHES,
    SERVER_HOSTS_AHEAD_OF_CLOCK,
    SERVER_AGENT_ID_FLAPS,
    SERVER_EVENTS_OPENED,
    SERVER_JOB_RUNS,
    SERVER_NOTIFICATIONS,
    SERVER_WRITE_TURN_WAIT_SECONDS,
    SERVER_WRITE_TURN_HELD_SECONDS,
    FLEET_OPEN_EVENTS,
    FLEET_ORPHANED_MEMORY_BYTES,
    FLEET_IDLE_MEMORY_BYTES,
    FLEET_AGENT_SPOOL_DROPPED,
    FLEET_AGENT_SILENT,
    FLEET_GPUS,
)  # the reference in docs/metrics.md

INGEST_PATH = "/api/v1/snapshots"
_RESULT_BY_STATUS = {
    200: "ok",
    400: "invalid",
    401: "unauthorized",
    403: "forbidden",
    413: "too_large",
    422: "invalid",
    429: "host_busy",
    503: "unavailable",
}
_OTHER_STATUS = "error"
# Where the status alone does not tell the result (a 422 for a valid batch the database
# refused to store, a 503 for a request past its time budget, a 200 that deferred part
# of its batch), the ingest view names it in the request's scope under this key.
INGEST_RESULT_SCOPE_KEY = "gpuwatch.ingest_result"

# Every value the counters' labels (and the open-events gauge's kind) can take, each
# exported at 0 from the first scrape: a series that first appears at its first
# increment hides that increment from rate() and increase(), and a kind with no open
# event would otherwise be absent rather than 0. Job names come from the scheduler
# (ServerStats.expect_jobs), which owns them.
INGEST_RESULTS = (
    *dict.fromkeys(_RESULT_BY_STATUS.values()),
    "partial",
    "over_budget",
    "slow_body",
    "quarantined",
    _OTHER_STATUS,
)
SNAPSHOT_RESULTS = ("accepted", "duplicate", "deferred")
JOB_RESULTS = ("ok", "failed", "skipped", "busy")
NOTIFICATION_OUTCOMES = ("sent", "retry", "broken", "failed")
# How long a host refused as from the future counts in gpuwatch_server_hosts_ahead_of_clock,
# and at most how often the writer says this server's clock is suspect.
AHEAD_WINDOW_SECONDS = 600.0


class ServerStats:
    """Thread-safe counters of this process (requests run in a thread pool)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.ingest_requests: Counter[str] = Counter()
        self.ingest_snapshots: Counter[str] = Counter()
        self.events_opened: Counter[str] = Counter()
        self.clock_stepped: Counter[None] = Counter()
        self.future_pushes: Counter[None] = Counter()
        self.agent_id_flaps: Counter[None] = Counter()
        # host id -> when its last push was refused as from the future (server clock).
        self._ahead: dict[int, float] = {}
        self._suspected_at = float("-inf")
        # host id -> (current agent_id, the one before it), and switches back, per host.
        self._agents: dict[int, tuple[str, str | None]] = {}
        self._flaps: Counter[int] = Counter()
        self.job_runs: Counter[tuple[str, str]] = Counter()
        self.notifications: Counter[tuple[str, str]] = Counter()
        self._jobs: dict[str, None] = {}
        self._receivers: dict[str, None] = {}

    def count(self, counter: Counter[Any], key: Any, n: int = 1) -> None:
        with self._lock:
            counter[key] += n

    def note_ahead(self, host_id: int, now: float) -> int:
        """Count a push of ``host_id`` refused as from the future; return how many hosts
        were within :data:`AHEAD_WINDOW_SECONDS`."""
        with self._lock:
            self.future_pushes[None] += 1
            self._ahead[host_id] = now
            return self._hosts_ahead(now)

    def hosts_ahead(self, now: float) -> int:
        with self._lock:
            return self._hosts_ahead(now)

    def _hosts_ahead(self, now: float) -> int:
        for host_id in [h for h, at in self._ahead.items() if at < now - AHEAD_WINDOW_SECONDS]:
            del self._ahead[host_id]
        return len(self._ahead)

    def suspect_server_clock(self, now: float) -> bool:
        """True at most once per :data:`AHEAD_WINDOW_SECONDS`: time to log it again."""
        with self._lock:
            if now - self._suspected_at < AHEAD_WINDOW_SECONDS:
                return False
            self._suspected_at = now
            return True

    def note_agent(self, host_id: int, agent_id: str) -> bool:
        """Record the agent_id a push of ``host_id`` came from; True when it switched
        back to the one before the current (counted): two agents alternate."""
        with self._lock:
            current, before = self._agents.get(host_id, (agent_id, None))
            if agent_id == current:
                self._agents[host_id] = (current, before)
                return False
            self._agents[host_id] = (agent_id, current)
            if agent_id != before:  # a new agent (reinstalled): not a flap
                return False
            self.agent_id_flaps[None] += 1
            self._flaps[host_id] += 1
            return True

    def agent_flaps_of(self, host_id: int) -> int:
        with self._lock:
            return self._flaps[host_id]

    def expect_jobs(self, names: Iterable[str]) -> None:
        """Declare the jobs this process schedules, so their run counters start at 0."""
        with self._lock:
            self._jobs.update(dict.fromkeys(names))

    def expect_receivers(self, names: Iterable[str]) -> None:
        """Declare the configured receivers, so their notification counters start at 0."""
        with self._lock:
            self._receivers.update(dict.fromkeys(names))

    def snapshot(self) -> dict[str, dict[Any, int]]:
        """Every counter, with each known label value present (0 until counted)."""
        with self._lock:
            jobs = {job: None for job, _ in self.job_runs} | self._jobs
            return {
                "ingest_requests": _with_zeros(INGEST_RESULTS, self.ingest_requests),
                "ingest_snapshots": _with_zeros(SNAPSHOT_RESULTS, self.ingest_snapshots),
                "events_opened": _with_zeros(EVENT_KINDS, self.events_opened),
                "clock_stepped": _with_zeros([None], self.clock_stepped),
                "future_pushes": _with_zeros([None], self.future_pushes),
                "agent_id_flaps": _with_zeros([None], self.agent_id_flaps),
                "job_runs": _with_zeros(
                    [(job, result) for job in sorted(jobs) for result in JOB_RESULTS],
                    self.job_runs,
                ),
                "notifications": _with_zeros(
                    [(r, outcome) for r in self._receivers for outcome in NOTIFICATION_OUTCOMES],
                    self.notifications,
                ),
            }


def _with_zeros(known: Iterable[Any], counts: Counter[Any]) -> dict[Any, int]:
    """``counts`` with every ``known`` key present: known keys first, in order, then the rest."""
    out = {key: counts.get(key, 0) for key in known}
    out.update((key, n) for key, n in sorted(counts.items()) if key not in out)
    return out


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
                result = scope.get(INGEST_RESULT_SCOPE_KEY) or _RESULT_BY_STATUS.get(
                    message["status"], _OTHER_STATUS
                )
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
        up = SERVER_DATABASE_UP.gauge()
        try:
            fleet = list(self._fleet_families())
        except SQLAlchemyError as err:
            log.warning("metrics: cannot read the database: %s", describe(err))
            up.add_metric([], 0)
        else:
            # Readable is not up when it cannot be written: every push would get 503.
            failure = self.database.write_failure()
            if failure is not None:
                log.warning("metrics: the database cannot be written: %s", failure)
            up.add_metric([], 0 if failure is not None else 1)
            yield from fleet
        yield up
        duration = SERVER_SCRAPE_DURATION_SECONDS.gauge()
        duration.add_metric([], time.perf_counter() - started)
        yield duration

    def _server_families(self) -> Iterator[Metric]:
        counts = self.stats.snapshot()
        requests = SERVER_INGEST_REQUESTS.counter()
        for result, n in counts["ingest_requests"].items():
            requests.add_metric([result], n)
        snapshots = SERVER_INGEST_SNAPSHOTS.counter()
        for result, n in counts["ingest_snapshots"].items():
            snapshots.add_metric([result], n)
        stepped = SERVER_CLOCK_STEPPED_SNAPSHOTS.counter()
        stepped.add_metric([], counts["clock_stepped"][None])
        future = SERVER_FUTURE_SNAPSHOT_PUSHES.counter()
        future.add_metric([], counts["future_pushes"][None])
        ahead = SERVER_HOSTS_AHEAD_OF_CLOCK.gauge()
        ahead.add_metric([], self.stats.hosts_ahead(self.clock()))
        flaps = SERVER_AGENT_ID_FLAPS.counter()
        flaps.add_metric([], counts["agent_id_flaps"][None])
        opened = SERVER_EVENTS_OPENED.counter()
        for kind, n in counts["events_opened"].items():
            opened.add_metric([kind], n)
        jobs = SERVER_JOB_RUNS.counter()
        for (job, result), n in counts["job_runs"].items():
            jobs.add_metric([job, result], n)
        notifications = SERVER_NOTIFICATIONS.counter()
        for (receiver, outcome), n in counts["notifications"].items():
            notifications.add_metric([receiver, outcome], n)
        yield from (requests, snapshots, stepped, future, ahead, flaps, opened, jobs, notifications)
        turns = self.database.write_turns
        if turns is not None:
            waited = SERVER_WRITE_TURN_WAIT_SECONDS.counter()
            waited.add_metric([], turns.wait_seconds)
            held = SERVER_WRITE_TURN_HELD_SECONDS.counter()
            held.add_metric([], turns.held_seconds)
            yield from (waited, held)

    def _fleet_families(self) -> Iterator[Metric]:
        now = self.clock()
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
                        (Host.last_received_at < silent_before(self.settings, now), 1),
                        else_=0,
                    ),
                ).where(Host.retired_at.is_(None))
            ).all()
        # Every kind and every host is present, at 0 when nothing is open or held: a
        # series that vanishes when its last event closes looks stale, not cleared.
        open_events = FLEET_OPEN_EVENTS.gauge()
        for kind, n in _with_zeros(EVENT_KINDS, Counter(dict(open_by_kind))).items():
            open_events.add_metric([kind], n)
        held_by = {(hostname, kind): total or 0 for hostname, kind, total in held}
        orphaned = FLEET_ORPHANED_MEMORY_BYTES.gauge()
        idle = FLEET_IDLE_MEMORY_BYTES.gauge()
        dropped = FLEET_AGENT_SPOOL_DROPPED.counter()
        silent = FLEET_AGENT_SILENT.gauge()
        for hostname, spool_dropped, is_silent in sorted(hosts):
            orphaned.add_metric([hostname], held_by.get((hostname, "orphaned"), 0))
            idle.add_metric([hostname], held_by.get((hostname, "idle"), 0))
            dropped.add_metric([hostname], spool_dropped)
            silent.add_metric([hostname], is_silent)
        gpus = FLEET_GPUS.gauge()
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
