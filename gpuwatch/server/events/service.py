"""Event queries, and events agents report themselves (``reaped``, ``oom``)."""

from __future__ import annotations

from typing import NamedTuple

from sqlalchemy import case, func, or_, select
from sqlalchemy.orm import Session

from gpuwatch.server.database.dialects import insert_ignoring_conflicts
from gpuwatch.server.events.models import Event
from gpuwatch.server.events.outbox import PendingChange, write_changes
from gpuwatch.server.events.schemas import EventOut, EventPage, IdleHolderOut
from gpuwatch.server.hosts.models import Host
from gpuwatch.server.pagination import Cursor, after, bytewise
from gpuwatch.wire import ReportedEvent, ReportedEventResult

# The list this module's cursors page (pagination.Cursor).
EVENTS = "events"


def list_events(
    *,
    session: Session,
    hostname: str | None = None,
    gpu_index: int | None = None,
    user: str | None = None,
    kind: str | None = None,
    since: float | None = None,
    until: float | None = None,
    is_open: bool | None = None,
    limit: int = 100,
    cursor: Cursor | None = None,
) -> EventPage:
    """Events matching every given filter, newest ``started_at`` first.

    ``since``/``until`` (epoch seconds) keep events that overlap the range: started at
    or before ``until`` and still open or ended at or after ``since``.
    """
    query = select(Event, Host.hostname).join(Host, Host.id == Event.host_id)
    if hostname is not None:
        query = query.where(Host.hostname == hostname)
    if gpu_index is not None:
        query = query.where(Event.gpu_index == gpu_index)
    if user is not None:
        query = query.where(Event.user == user)
    if kind is not None:
        query = query.where(Event.kind == kind)
    if since is not None:
        query = query.where(or_(Event.ended_at.is_(None), Event.ended_at >= since))
    if until is not None:
        query = query.where(Event.started_at <= until)
    if is_open is not None:
        query = query.where(Event.ended_at.is_(None) if is_open else Event.ended_at.is_not(None))
    clause = after(cursor, EVENTS, Event.started_at, Event.id)
    if clause is not None:
        query = query.where(clause)
    rows = session.execute(
        query.order_by(Event.started_at.desc(), Event.id.desc()).limit(limit + 1)
    ).all()
    items = [to_out(event, hostname) for event, hostname in rows[:limit]]
    next_cursor = None
    if len(rows) > limit:
        next_cursor = Cursor(EVENTS, t=items[-1].started_at, id=items[-1].id).encode()
    return EventPage(items=items, next_cursor=next_cursor)


def record_reported_event(
    *, session: Session, host_id: int, report: ReportedEvent, dialect: str
) -> ReportedEventResult:
    """Store a point event an agent reported, with its outbox row; a retry of the
    same one stores nothing.

    "The same" is the same kind, GPU, PID and ``occurred_at`` on the same host.
    """
    key = f"{report.kind}:gpu{report.gpu_index}:pid{report.pid}"
    inserted = session.execute(
        insert_ignoring_conflicts(Event.__table__, dialect)  # type: ignore[arg-type]
        .values(
            kind=report.kind,
            reason=report.kind,
            host_id=host_id,
            dedup_key=key,
            gpu_index=report.gpu_index,
            pid=report.pid,
            user=report.user,
            held_bytes=report.held_bytes,
            summary=report.summary,
            evidence=report.evidence,
            started_at=report.occurred_at,
            last_seen_at=report.occurred_at,
            ended_at=report.occurred_at,
        )
        .returning(Event.__table__.c.id)
    ).scalar()
    if inserted is not None:
        change = PendingChange(
            _Written(inserted), "recorded", report.kind, report.kind, report.occurred_at
        )
        write_changes(session.connection(), host_id, [change])
    return ReportedEventResult(id=inserted, duplicate=inserted is None)


class _Written(NamedTuple):
    id: int


def top_idle_users(
    *, session: Session, since: float, until: float, limit: int = 10
) -> list[IdleHolderOut]:
    """Users ranked by idle holding in ``[since, until]``: held bytes x seconds flagged,
    ties by user (bytewise, no user last), so both databases name the same users.

    Counts the time each ``idle`` event was open within the range (an event opens
    once a holder has already been idle for the whole idle window, so this is a floor).
    Users with none (their events held no bytes within the range) are not ranked.
    """
    end = func.coalesce(Event.ended_at, Event.last_seen_at)
    clipped_end = case((end > until, until), else_=end)
    clipped_start = case((Event.started_at < since, since), else_=Event.started_at)
    seconds = case((clipped_end > clipped_start, clipped_end - clipped_start), else_=0.0)
    byte_seconds = func.sum(func.coalesce(Event.held_bytes, 0) * seconds)
    rows = session.execute(
        select(Event.user, func.count(Event.id), byte_seconds, func.max(Event.held_bytes))
        .where(
            Event.kind == "idle",
            Event.started_at <= until,
            or_(Event.ended_at.is_(None), Event.ended_at >= since),
        )
        .group_by(Event.user)
        .having(byte_seconds > 0)
        .order_by(byte_seconds.desc(), bytewise(Event.user).asc().nulls_last())
        .limit(limit)
    ).all()
    return [
        IdleHolderOut(
            user=user, events=count, held_byte_seconds=float(total or 0), max_held_bytes=peak
        )
        for user, count, total, peak in rows
    ]


def to_out(event: Event, hostname: str) -> EventOut:
    return EventOut(
        id=event.id,
        kind=event.kind,  # type: ignore[arg-type]
        reason=event.reason,
        hostname=hostname,
        gpu_index=event.gpu_index,
        gpu_uuid=event.gpu_uuid,
        pid=event.pid,
        user=event.user,
        held_bytes=event.held_bytes,
        summary=event.summary,
        evidence=event.evidence,
        started_at=event.started_at,
        last_seen_at=event.last_seen_at,
        ended_at=event.ended_at,
        open=event.ended_at is None,
    )
