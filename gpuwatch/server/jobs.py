"""Periodic jobs. Each takes the database and ``now`` (epoch seconds) and opens its own
sessions, so tests call them directly with an injected time; :mod:`.scheduler` runs
them on a timer with a lock and an exception guard.

All three are idempotent: running one twice, or on two replicas one after the other,
changes nothing the first run did not.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from sqlalchemy import ColumnElement, Table, case, delete, func, literal, select, tuple_, update

from gpuwatch.server.database.core import Database
from gpuwatch.server.events.book import SILENT_KEY, Condition, EventBook
from gpuwatch.server.events.models import Event
from gpuwatch.server.hosts.models import GpuSample, Host
from gpuwatch.server.hosts.service import (
    silence_threshold,
    silence_threshold_seconds,
    silent_before,
)
from gpuwatch.server.ingest.apply import end_all_lifetimes
from gpuwatch.server.ingest.models import SnapshotSeen
from gpuwatch.server.ingest.state import HostState
from gpuwatch.server.processes.models import ProcessLifetime, ProcessSample
from gpuwatch.settings import ServerSettings

log = logging.getLogger(__name__)

# Rows deleted per retention transaction: small enough that SQLite's write lock is
# held for milliseconds, so ingest keeps flowing while history is trimmed.
RETENTION_BATCH = 5000
# Hosts per agent_silent transaction: a fleet-wide outage is thousands of hosts at once.
SILENT_BATCH = 100


def purge_expired(*, database: Database, settings: ServerSettings, now: float) -> dict[str, int]:
    """Delete what is older than ``retention_days``; return rows deleted per table.

    Samples by their time; events and process lifetimes once they have been closed
    for that long (open ones are kept however old); idempotency keys by arrival.
    """
    cutoff = now - settings.retention_days * 86400
    targets: list[tuple[Any, ColumnElement[bool]]] = [
        (ProcessSample, ProcessSample.t < cutoff),
        (GpuSample, GpuSample.t < cutoff),
        (Event, Event.ended_at < cutoff),
        (ProcessLifetime, ProcessLifetime.ended_at < cutoff),
        (SnapshotSeen, SnapshotSeen.received_at < cutoff),
    ]
    deleted: dict[str, int] = {}
    for model, condition in targets:
        table: Table = model.__table__
        deleted[table.name] = _delete_in_batches(database, table, condition)
    if any(deleted.values()):
        log.info("retention: deleted %s", deleted)
    return deleted


def _delete_in_batches(database: Database, table: Table, condition: ColumnElement[bool]) -> int:
    key = tuple_(*table.primary_key.columns)
    total = 0
    while True:
        with database.writer() as session, session.begin():
            batch = select(*table.primary_key.columns).where(condition).limit(RETENTION_BATCH)
            count = session.execute(delete(table).where(key.in_(batch))).rowcount  # type: ignore[attr-defined]
        total += count
        if count < RETENTION_BATCH:
            return total


def detect_silent_agents(
    *, database: Database, settings: ServerSettings, now: float, up_since: float | None = None
) -> int:
    """Open an ``agent_silent`` event per host that stopped pushing; return how many.

    Silent: no snapshot received for ``agent_silent_intervals`` push intervals
    (server clock), counted from when this server started (``up_since``) at the
    earliest: while the server itself was down or restarting, agents spool and push
    nothing, and that is not their silence. Hosts that never reported are left alone:
    a token was made, no agent runs yet. Open events of hosts that report again are closed (ingest
    closes them too; this catches an event opened while a push was in flight). Events
    go through each host's :class:`EventBook`, the one path that writes events and
    their outbox rows.

    Cost: an open event of a host still silent is refreshed (its ``last_seen_at`` and
    the silence in its summary) once per threshold, not on every run, and hosts are
    written :data:`SILENT_BATCH` to a transaction. With a thousand hosts down, one
    transaction refreshing all of them every push interval held SQLite's write turn
    for seconds each time, and every push of the live hosts waited behind it.
    """
    with database.reader() as session:
        # Each host's threshold is its own (its agent's push interval). A host is judged
        # once this server has been up for its threshold: before that, its silence may
        # be this server's own outage, and an event already open stays as it is
        # (ingest closes those of hosts that report).
        thresholds: dict[int, float] = {
            host_id: silence_threshold_seconds(settings, interval)
            for host_id, interval in session.execute(
                select(Host.id, Host.push_interval_seconds).where(Host.retired_at.is_(None))
            )
        }
        judged = {
            host_id
            for host_id, threshold in thresholds.items()
            if up_since is None or up_since <= now - threshold
        }
        silent = judged & set(
            session.scalars(
                select(Host.id).where(
                    Host.last_received_at < silent_before(settings, now),
                    Host.retired_at.is_(None),
                )
            )
        )
        open_seen: dict[int, float] = {
            host_id: seen
            for host_id, seen in session.execute(
                select(Event.host_id, Event.last_seen_at).where(
                    Event.kind == "agent_silent", Event.ended_at.is_(None)
                )
            )
        }
    due = sorted(
        {
            host_id
            for host_id in silent
            if open_seen.get(host_id, -math.inf) < now - thresholds[host_id]
        }
        | (open_seen.keys() & judged - silent)
    )
    opened = 0
    for first in range(0, len(due), SILENT_BATCH):
        opened += _mark_silent(database, due[first : first + SILENT_BATCH], settings, now=now)
    if opened:
        log.warning("%d agent(s) went silent", opened)
    return opened


def _mark_silent(
    database: Database, host_ids: list[int], settings: ServerSettings, *, now: float
) -> int:
    """Open or refresh the silent events of ``host_ids`` still silent, close those of the
    others; one transaction. Return how many were opened."""
    opened = 0
    with database.writer() as session, session.begin():
        # FOR UPDATE (Postgres) serialises with ingest of the same host, which locks
        # the host row first; the WHERE is re-checked once the lock is granted.
        silent = session.scalars(
            select(Host)
            .where(
                Host.id.in_(host_ids),
                Host.last_received_at < silent_before(settings, now),
                Host.retired_at.is_(None),
            )
            .order_by(Host.id)
            .with_for_update()
        ).all()
        silent_ids = {host.id for host in silent}
        for host in silent:
            assert host.last_received_at is not None
            book = EventBook.load(session=session, host_id=host.id)
            threshold = silence_threshold_seconds(settings, host.push_interval_seconds)
            condition = _silent_condition(host, threshold=threshold, now=now)
            if not book.is_open(SILENT_KEY):
                # Silent since the moment the threshold passed, not since this run noticed.
                book.observe(SILENT_KEY, condition, at=host.last_received_at + threshold)
                opened += 1
            book.observe(SILENT_KEY, condition, at=now)
            book.flush(session=session)
        for host_id in set(host_ids) - silent_ids:
            book = EventBook.load(session=session, host_id=host_id)
            book.clear(SILENT_KEY, at=now)
            book.flush(session=session)
        # Open events are part of the ingest state that server processes keep.
        session.execute(
            update(Host)
            .where(Host.id.in_(host_ids))
            .values(state_version=Host.state_version + 1)
            .execution_options(synchronize_session=False)
        )
    return opened


def _silent_condition(host: Host, *, threshold: float, now: float) -> Condition:
    assert host.last_received_at is not None
    quiet = now - host.last_received_at
    return Condition(
        kind="agent_silent",
        reason="no_snapshots",
        summary=f"no snapshot from {host.hostname} for {quiet / 60:.1f} min",
        evidence={
            "last_received_at": host.last_received_at,
            "last_seen_at": host.last_seen_at,
            "threshold_seconds": threshold,
        },
    )


# How long a host must have been silent before its lifetimes end (at least the silence
# threshold): an agent spools through a network blip and replays every poll, and ending
# its lifetimes meanwhile split each open event in two (the replay opened new ones),
# restarting the clocks of the alerts that wait on them.
STALE_LIFETIME_SECONDS = 300.0


def close_stale_lifetimes(
    *, database: Database, settings: ServerSettings, now: float, up_since: float | None = None
) -> int:
    """End the open lifetimes of silent hosts at their last observation; return how many.

    Nobody can see those processes any more, so "open" would be a claim without
    evidence; their events end with them. A process with a known start time that
    reappears when the agent returns reopens its lifetime. One transaction per host.
    Silent for :data:`STALE_LIFETIME_SECONDS` at least, and not judged before this
    server (``up_since``) has been up for that long.
    """

    def threshold(push_interval: float | None) -> float:
        return max(silence_threshold_seconds(settings, push_interval), STALE_LIFETIME_SECONDS)

    # The same per host, in SQL: its silence threshold or STALE_LIFETIME_SECONDS,
    # whichever is longer.
    stale_after = case(
        (silence_threshold(settings) > STALE_LIFETIME_SECONDS, silence_threshold(settings)),
        else_=literal(STALE_LIFETIME_SECONDS),
    )
    stale = Host.last_received_at < now - stale_after
    if up_since is not None:
        # Not judged before this server has been up that long: the hosts' silence may
        # be this server's own outage.
        stale &= stale_after <= now - up_since
    with database.reader() as session:
        host_ids = session.scalars(
            select(Host.id)
            .where(stale)
            .where(
                select(func.count(ProcessLifetime.id))
                .where(ProcessLifetime.host_id == Host.id, ProcessLifetime.ended_at.is_(None))
                .scalar_subquery()
                > 0
            )
        ).all()
    closed = 0
    for host_id in host_ids:
        with database.writer() as session, session.begin():
            state = HostState.load(session=session, dialect=database.dialect, host_id=host_id)
            stale_before = now - threshold(state.host.push_interval_seconds)
            if state.host.last_received_at is None or state.host.last_received_at >= stale_before:
                continue  # it reported while we were looking
            closed += end_all_lifetimes(state)
            state.flush()
    if closed:
        log.info("closed %d lifetime(s) of silent hosts", closed)
    return closed
