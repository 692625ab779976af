"""History queries over process lifetimes: "what was on host-3 GPU 2 at 14:05"."""

from __future__ import annotations

from sqlalchemy import Select, and_, or_, select
from sqlalchemy.orm import Session

from gpuwatch.server.hosts.models import Gpu, Host
from gpuwatch.server.pagination import Cursor, after
from gpuwatch.server.processes.models import ProcessLifetime, ProcessSample
from gpuwatch.server.processes.schemas import (
    ProcessOut,
    ProcessPage,
    ProcessSampleOut,
    ProcessSamples,
)


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
    query = _base_query()
    if hostname is not None:
        query = query.where(Host.hostname == hostname)
    if gpu_index is not None:
        query = query.where(Gpu.gpu_index == gpu_index)
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
    clause = after(cursor, ProcessLifetime.first_seen_at, ProcessLifetime.id)
    if clause is not None:
        query = query.where(clause)
    rows = session.execute(
        query.order_by(ProcessLifetime.first_seen_at.desc(), ProcessLifetime.id.desc()).limit(
            limit + 1
        )
    ).all()
    items = [to_out(*row) for row in rows[:limit]]
    next_cursor = None
    if len(rows) > limit:
        last = items[-1]
        next_cursor = Cursor(t=last.first_seen_at, id=last.id).encode()
    return ProcessPage(items=items, next_cursor=next_cursor)


def open_processes(*, session: Session, host_id: int) -> list[ProcessOut]:
    """The lifetimes of ``host_id`` that are still open, largest holders first."""
    rows = session.execute(
        _base_query()
        .where(ProcessLifetime.host_id == host_id, ProcessLifetime.ended_at.is_(None))
        .order_by(ProcessLifetime.current_bytes.desc().nulls_last(), ProcessLifetime.id)
    ).all()
    return [to_out(*row) for row in rows]


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
        lifetime=to_out(*row),
        sample_interval_seconds=sample_interval_seconds,
        samples=[ProcessSampleOut.model_validate(s) for s in reversed(newest[:limit])],
        truncated=len(newest) > limit,
    )


def _base_query() -> Select[ProcessLifetime, str, int, str]:
    return (
        select(ProcessLifetime, Host.hostname, Gpu.gpu_index, Gpu.uuid)
        .join(Host, Host.id == ProcessLifetime.host_id)
        .join(Gpu, Gpu.id == ProcessLifetime.gpu_id)
    )


def to_out(lifetime: ProcessLifetime, hostname: str, gpu_index: int, uuid: str) -> ProcessOut:
    idle_seconds = (
        None
        if lifetime.idle_since is None
        else max(0.0, lifetime.last_seen_at - lifetime.idle_since)
    )
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
        orphaned=lifetime.orphaned,
        first_seen_at=lifetime.first_seen_at,
        last_seen_at=lifetime.last_seen_at,
        ended_at=lifetime.ended_at,
        current_bytes=lifetime.current_bytes,
        peak_bytes=lifetime.peak_bytes,
        sm_ratio=lifetime.sm_ratio,
        idle_since=lifetime.idle_since,
        idle_seconds=idle_seconds,
    )
