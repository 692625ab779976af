"""History queries over process lifetimes: "what was on host-3 GPU 2 at 14:05"."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import ColumnElement, Select, and_, func, or_, select
from sqlalchemy.orm import Session

from gpuwatch.server.events.models import Event
from gpuwatch.server.hosts.models import Gpu, GpuIndex, Host
from gpuwatch.server.pagination import Cursor, after
from gpuwatch.server.processes.models import ProcessLifetime, ProcessSample
from gpuwatch.server.processes.schemas import (
    ProcessOut,
    ProcessPage,
    ProcessSampleOut,
    ProcessSamples,
)

# The list this module's cursors page (pagination.Cursor).
PROCESSES = "processes"


def list_processes(
    *,
    session: Session,
    hostname: str | None = None,
    gpu_index: int | None = None,
    user: str | None = None,
    at: float | None = None,
    open_only: bool = False,
    limit: int = 100,
    cursor: Cursor | None = None,
) -> ProcessPage:
    """Lifetimes matching every given filter, newest ``first_seen_at`` first.

    ``at`` (epoch seconds) keeps the lifetimes that held their GPU at that moment:
    first seen at or before it, and either ended after it or still open and seen
    since. ``open_only`` keeps the ones still holding memory now.
    """
    query = _base_query(at)
    if hostname is not None:
        query = query.where(Host.hostname == hostname)
    if gpu_index is not None:
        query = query.where(_held(gpu_index, at))
    if user is not None:
        query = query.where(ProcessLifetime.user == user)
    if open_only:
        query = query.where(ProcessLifetime.ended_at.is_(None))
    if at is not None:
        query = query.where(
            ProcessLifetime.first_seen_at <= at,
            or_(
                ProcessLifetime.ended_at > at,
                and_(ProcessLifetime.ended_at.is_(None), ProcessLifetime.last_seen_at >= at),
            ),
        )
    clause = after(cursor, PROCESSES, ProcessLifetime.first_seen_at, ProcessLifetime.id)
    if clause is not None:
        query = query.where(clause)
    rows = session.execute(
        query.order_by(ProcessLifetime.first_seen_at.desc(), ProcessLifetime.id.desc()).limit(
            limit + 1
        )
    ).all()
    items = to_outs(session, rows[:limit])
    next_cursor = None
    if len(rows) > limit:
        last = items[-1]
        next_cursor = Cursor(PROCESSES, t=last.first_seen_at, id=last.id).encode()
    return ProcessPage(items=items, next_cursor=next_cursor)


def open_processes(*, session: Session, host_id: int) -> list[ProcessOut]:
    """The lifetimes of ``host_id`` that are still open, largest holders first."""
    rows = session.execute(
        _base_query()
        .where(ProcessLifetime.host_id == host_id, ProcessLifetime.ended_at.is_(None))
        .order_by(ProcessLifetime.current_bytes.desc().nulls_last(), ProcessLifetime.id)
    ).all()
    return to_outs(session, rows)


def process_samples(
    *,
    session: Session,
    lifetime_id: int,
    sample_interval_seconds: float,
    since: float | None = None,
    until: float | None = None,
    limit: int = 1440,
) -> ProcessSamples | None:
    """The lifetime ``lifetime_id`` and its closed buckets with ``since <= t < until``,
    oldest first; ``None`` when there is no such lifetime.

    Past ``limit`` the *newest* samples are kept (what a recent-window check reads)
    and ``truncated`` says so. The bucket being filled is not a sample yet.
    """
    row = session.execute(_base_query().where(ProcessLifetime.id == lifetime_id)).first()
    if row is None:
        return None
    query = select(ProcessSample).where(ProcessSample.lifetime_id == lifetime_id)
    if since is not None:
        query = query.where(ProcessSample.t >= since)
    if until is not None:
        query = query.where(ProcessSample.t < until)
    newest = session.scalars(query.order_by(ProcessSample.t.desc()).limit(limit + 1)).all()
    return ProcessSamples(
        lifetime=to_outs(session, [row])[0],
        sample_interval_seconds=sample_interval_seconds,
        samples=[ProcessSampleOut.model_validate(s) for s in reversed(newest[:limit])],
        truncated=len(newest) > limit,
    )


def index_at(t: Any) -> ColumnElement[int]:
    """The index the lifetime's GPU had at ``t`` (a value or a lifetime column), from
    the GPU's recorded indices (:class:`GpuIndex`); the index it has now where none
    was recorded by then. Indices move between boots, so the GPU's own (last known)
    index would put another user's process on "GPU 2 at 14:05"."""
    recorded = (
        select(GpuIndex.gpu_index)
        .where(GpuIndex.gpu_id == ProcessLifetime.gpu_id, GpuIndex.since <= t)
        .order_by(GpuIndex.since.desc())
        .limit(1)
        .correlate(ProcessLifetime)
        .scalar_subquery()
    )
    return func.coalesce(recorded, Gpu.gpu_index)


def _held(gpu_index: int, at: float | None) -> ColumnElement[bool]:
    """The lifetime's GPU had index ``gpu_index`` at ``at``, or (no ``at``) at some
    moment of the lifetime: when it was first seen, or from a change recorded before
    its end (a lifetime reopened across a boot that renumbered its GPU)."""
    if at is not None:
        return index_at(at) == gpu_index
    end = func.coalesce(ProcessLifetime.ended_at, ProcessLifetime.last_seen_at)
    changed_to = (
        select(GpuIndex.gpu_id)
        .where(
            GpuIndex.gpu_id == ProcessLifetime.gpu_id,
            GpuIndex.gpu_index == gpu_index,
            GpuIndex.since > ProcessLifetime.first_seen_at,
            GpuIndex.since <= end,
        )
        .correlate(ProcessLifetime)
        .exists()
    )
    return or_(index_at(ProcessLifetime.first_seen_at) == gpu_index, changed_to)


def _base_query(at: float | None = None) -> Select[ProcessLifetime, str, int, str]:
    """Lifetimes with their hostname, GPU index and UUID: the index the GPU had at
    ``at`` (a history query's moment) or else at the lifetime's last observation."""
    index = index_at(ProcessLifetime.last_seen_at if at is None else at)
    return (
        select(ProcessLifetime, Host.hostname, index, Gpu.uuid)
        .join(Host, Host.id == ProcessLifetime.host_id)
        .join(Gpu, Gpu.id == ProcessLifetime.gpu_id)
    )


def to_outs(session: Session, rows: Sequence[Any]) -> list[ProcessOut]:
    """Rows of :func:`_base_query` (lifetime, hostname, GPU index, UUID) in the read
    API's shape, each with its open ``orphaned`` event's reason (one query for all)."""
    reasons = open_orphan_reasons(session, [row[0].id for row in rows])
    return [to_out(*row, orphan_reason=reasons.get(row[0].id)) for row in rows]


# Lifetime ids per query: far under any driver's limit on bound parameters.
_IDS_PER_QUERY = 500


def open_orphan_reasons(session: Session, lifetime_ids: Sequence[int]) -> dict[int, str]:
    """Lifetime id -> the reason of its open ``orphaned`` event (``dead_pid``,
    ``reparented``, ...), for those of ``lifetime_ids`` that have one."""
    reasons: dict[int, str] = {}
    for start in range(0, len(lifetime_ids), _IDS_PER_QUERY):
        chunk = lifetime_ids[start : start + _IDS_PER_QUERY]
        rows = session.execute(
            select(Event.lifetime_id, Event.reason).where(
                Event.lifetime_id.in_(chunk), Event.kind == "orphaned", Event.ended_at.is_(None)
            )
        ).all()
        reasons.update({lifetime_id: reason for lifetime_id, reason in rows if lifetime_id})
    return reasons


def to_out(
    lifetime: ProcessLifetime,
    hostname: str,
    gpu_index: int,
    uuid: str,
    *,
    orphan_reason: str | None = None,
) -> ProcessOut:
    """``orphan_reason``: that of the lifetime's open ``orphaned`` event, if any
    (:func:`open_orphan_reasons`). Such a process is orphaned whatever the agent's
    parent check said (a dead PID has no parent to check) and is not called idle:
    orphaned takes precedence over idle, as for events (docs/detection.md), and nobody
    will come back to a dead PID's memory."""
    orphaned = lifetime.orphaned or orphan_reason is not None
    idle_since = None if orphan_reason is not None else lifetime.idle_since
    idle_seconds = None if idle_since is None else max(0.0, lifetime.last_seen_at - idle_since)
    return ProcessOut(
        id=lifetime.id,
        hostname=hostname,
        gpu_index=gpu_index,
        gpu_uuid=uuid,
        pid=lifetime.pid,
        start_time=lifetime.start_time,
        kind=lifetime.kind,
        name=lifetime.name,
        command=lifetime.command,
        user=lifetime.user,
        uid=lifetime.uid,
        container_id=lifetime.container_id,
        pod_uid=lifetime.pod_uid,
        slurm_job_id=lifetime.slurm_job_id,
        orphaned=orphaned,
        orphan_reason=orphan_reason,
        first_seen_at=lifetime.first_seen_at,
        last_seen_at=lifetime.last_seen_at,
        ended_at=lifetime.ended_at,
        current_bytes=lifetime.current_bytes,
        peak_bytes=lifetime.peak_bytes,
        sm_ratio=lifetime.sm_ratio,
        idle_since=idle_since,
        idle_seconds=idle_seconds,
    )
