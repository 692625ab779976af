"""Hosts and GPUs: creation (with a token), listing, detail."""

from __future__ import annotations

from sqlalchemy import ColumnElement, func, select
from sqlalchemy.orm import Session

from gpuwatch.server.hosts.models import Gpu, Host
from gpuwatch.server.hosts.schemas import GpuOut, HostDetail, HostOut
from gpuwatch.server.processes import service as process_service
from gpuwatch.settings import ServerSettings


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
    rows = session.execute(select(Host, gpu_count).order_by(Host.hostname)).all()
    return [_host_out(host, count, now=now, settings=settings) for host, count in rows]


def get_host(
    *, session: Session, hostname: str, settings: ServerSettings, now: float
) -> HostDetail | None:
    """One host with its GPUs (by index) and their open process lifetimes; None if unknown."""
    host = session.scalars(select(Host).where(Host.hostname == hostname)).first()
    if host is None:
        return None
    gpus = session.scalars(
        select(Gpu).where(Gpu.host_id == host.id).order_by(Gpu.gpu_index, Gpu.uuid)
    ).all()
    processes = process_service.open_processes(session=session, host_id=host.id)
    summary = _host_out(host, len(gpus), now=now, settings=settings)
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
                processes=[p for p in processes if p.gpu_uuid == gpu.uuid],
            )
            for gpu in gpus
        ],
    )


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
