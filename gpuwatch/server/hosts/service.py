"""Hosts and GPUs: creation (with a token), listing, detail."""

from __future__ import annotations

from sqlalchemy import ColumnElement, func, select
from sqlalchemy.orm import Session

from gpuwatch.server.hosts.models import Gpu, Host
from gpuwatch.server.hosts.schemas import GpuOut, HostDetail, HostOut
from gpuwatch.server.pagination import bytewise
from gpuwatch.server.processes import service as process_service
from gpuwatch.server.processes.models import ProcessLifetime
from gpuwatch.server.processes.schemas import ProcessOut
from gpuwatch.settings import ServerSettings

# Open processes listed per GPU in a host's detail (the API and the dashboard pages),
# the largest holders first; the rest are counted, and paged by GET /api/v1/processes.
MAX_PROCESSES_SHOWN = 100


def silence_threshold_seconds(
    settings: ServerSettings, push_interval: float | None = None
) -> float:
    """Seconds without a snapshot after which a host's agent counts as silent:
    ``agent_silent_intervals`` of the push interval its agent reports
    (``Host.push_interval_seconds``), or of ``agent_push_interval_seconds`` where it
    reports none. Counted in each host's own interval, so agents that push every minute
    beside others that push every 15 s are neither silent between their pushes nor
    judged by the slower ones' pace."""
    interval = settings.agent_push_interval_seconds if push_interval is None else push_interval
    return settings.agent_silent_intervals * interval


def silence_threshold(settings: ServerSettings) -> ColumnElement[float]:
    """:func:`silence_threshold_seconds` of each host, in SQL."""
    interval = func.coalesce(Host.push_interval_seconds, settings.agent_push_interval_seconds)
    return settings.agent_silent_intervals * interval


def silent_before(settings: ServerSettings, now: float) -> ColumnElement[float]:
    """The time each host's last snapshot must be older than for it to be silent at
    ``now`` (SQL)."""
    return now - silence_threshold(settings)


def get_or_create_host(*, session: Session, hostname: str, now: float) -> Host:
    """The host named ``hostname``, created if missing."""
    host = session.scalars(select(Host).where(Host.hostname == hostname)).first()
    if host is None:
        host = Host(hostname=hostname, created_at=now, spool_dropped_total=0)
        session.add(host)
        session.flush()
    return host


def list_hosts(*, session: Session, settings: ServerSettings, now: float) -> list[HostOut]:
    """Every host, by name, with its GPU count and silence."""
    gpu_count = (
        select(func.count(Gpu.id)).where(Gpu.host_id == Host.id).correlate(Host).scalar_subquery()
    )
    rows = session.execute(select(Host, gpu_count).order_by(bytewise(Host.hostname))).all()
    return [_host_out(host, count, now=now, settings=settings) for host, count in rows]


def get_host(
    *,
    session: Session,
    hostname: str,
    settings: ServerSettings,
    now: float,
    gpu_index: int | None = None,
) -> HostDetail | None:
    """One host with its GPUs (by index) and, for each, its largest open process
    lifetimes (at most :data:`MAX_PROCESSES_SHOWN`, with their count); None if unknown.
    ``gpu_index``: only that GPU (its page), not the host's others."""
    host = session.scalars(select(Host).where(Host.hostname == hostname)).first()
    if host is None:
        return None
    all_gpus = session.scalars(
        select(Gpu).where(Gpu.host_id == host.id).order_by(Gpu.gpu_index, Gpu.uuid)
    ).all()
    gpus = [g for g in all_gpus if gpu_index is None or g.gpu_index == gpu_index]
    processes = _largest_open(session, host.id, [g.id for g in gpus])
    totals = _open_counts(session, host.id, [g.id for g in gpus])
    summary = _host_out(host, len(all_gpus), now=now, settings=settings)
    return HostDetail(
        **summary.model_dump(),
        gpus=[
            GpuOut(
                index=gpu.gpu_index,
                uuid=gpu.uuid,
                name=gpu.name,
                lost=gpu.lost,
                read_error=gpu.read_error,
                memory_total_bytes=gpu.memory_total_bytes,
                memory_used_bytes=gpu.memory_used_bytes,
                memory_free_bytes=gpu.memory_free_bytes,
                unattributed_bytes=gpu.unattributed_bytes,
                utilization_ratio=gpu.utilization_ratio,
                last_seen_at=gpu.last_seen_at,
                processes=processes.get(gpu.id, []),
                processes_total=totals.get(gpu.id, 0),
                processes_truncated=totals.get(gpu.id, 0) > len(processes.get(gpu.id, [])),
            )
            for gpu in gpus
        ],
    )


def _largest_open(
    session: Session, host_id: int, gpu_ids: list[int]
) -> dict[int, list[ProcessOut]]:
    """Each GPU's largest open lifetimes (GPU id -> at most MAX_PROCESSES_SHOWN), in one
    query: a host of 64 GPUs x 300 processes answered 8.7 MiB in 5-8 s when every open
    lifetime was listed, and its one-GPU page read them all to show 300."""
    if not gpu_ids:
        return {}
    rank = (
        func.row_number()
        .over(
            partition_by=ProcessLifetime.gpu_id,
            order_by=(ProcessLifetime.current_bytes.desc().nulls_last(), ProcessLifetime.id),
        )
        .label("rank")
    )
    ranked = (
        select(ProcessLifetime.id, rank)
        .where(
            ProcessLifetime.host_id == host_id,
            ProcessLifetime.ended_at.is_(None),
            ProcessLifetime.gpu_id.in_(gpu_ids),
        )
        .subquery()
    )
    chosen = select(ranked.c.id).where(ranked.c.rank <= MAX_PROCESSES_SHOWN)
    rows = session.execute(
        select(ProcessLifetime, Host.hostname, Gpu.gpu_index, Gpu.uuid)
        .join(Host, Host.id == ProcessLifetime.host_id)
        .join(Gpu, Gpu.id == ProcessLifetime.gpu_id)
        .where(ProcessLifetime.id.in_(chosen))
        .order_by(ProcessLifetime.current_bytes.desc().nulls_last(), ProcessLifetime.id)
    ).all()
    by_gpu: dict[int, list[ProcessOut]] = {}
    # The read API's one shape of a lifetime (processes/service.py), with its open
    # orphaned event's state: a dead PID is orphaned, not idle.
    for row, out in zip(rows, process_service.to_outs(session, rows), strict=True):
        by_gpu.setdefault(row[0].gpu_id, []).append(out)
    return by_gpu


def _open_counts(session: Session, host_id: int, gpu_ids: list[int]) -> dict[int, int]:
    rows = session.execute(
        select(ProcessLifetime.gpu_id, func.count(ProcessLifetime.id))
        .where(
            ProcessLifetime.host_id == host_id,
            ProcessLifetime.ended_at.is_(None),
            ProcessLifetime.gpu_id.in_(gpu_ids),
        )
        .group_by(ProcessLifetime.gpu_id)
    ).all()
    return {gpu_id: count for gpu_id, count in rows}


def _host_out(host: Host, gpu_count: int, *, now: float, settings: ServerSettings) -> HostOut:
    threshold = silence_threshold_seconds(settings, host.push_interval_seconds)
    received = host.last_received_at
    return HostOut(
        hostname=host.hostname,
        agent_id=host.agent_id,
        boot_id=host.boot_id,
        driver_version=host.driver_version,
        cuda_driver_version=host.cuda_driver_version,
        fake=host.fake,
        gpu_count=gpu_count,
        last_seen_at=host.last_seen_at,
        last_received_at=received,
        # A host that never reported (token created, agent not yet running) is silent;
        # a retired one is not watched (hosts/retire.py).
        silent=host.retired_at is None and (received is None or now - received > threshold),
        spool_dropped_total=host.spool_dropped_total,
        retired_at=host.retired_at,
    )
