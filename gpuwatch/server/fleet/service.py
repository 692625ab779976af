"""The fleet summary: fullness, memory held by orphans and idle holders, silence."""

from __future__ import annotations

from sqlalchemy import Float, case, cast, func, select
from sqlalchemy.orm import Session

from gpuwatch.server.events import service as event_service
from gpuwatch.server.events.models import Event
from gpuwatch.server.fleet.schemas import (
    FULL_BUCKET,
    FULLNESS_BUCKETS,
    UNKNOWN_BUCKET,
    FleetOut,
)
from gpuwatch.server.hosts.models import Gpu, Host
from gpuwatch.server.hosts.service import silent_before
from gpuwatch.server.pagination import bytewise
from gpuwatch.settings import ServerSettings

TOP_IDLE = 10
HELD_KINDS = ("orphaned", "idle")  # the events whose held memory the summary sums


def gpus_by_fullness(*, session: Session, settings: ServerSettings, now: float) -> dict[str, int]:
    """GPU count per used/total bucket, every bucket present (one grouped query).

    GPUs of silent hosts count as unknown: their last reading is stale. Retired hosts
    (hosts/retire.py) are not in the fleet.
    """
    reporting = func.coalesce(Host.last_received_at, 0.0) >= silent_before(settings, now)
    known = (
        reporting
        & ~Gpu.lost
        & Gpu.memory_used_bytes.is_not(None)
        & (func.coalesce(Gpu.memory_total_bytes, 0) > 0)
    )
    ratio = cast(Gpu.memory_used_bytes, Float) / Gpu.memory_total_bytes
    bucket = case(
        (~known, UNKNOWN_BUCKET),
        *((ratio < bound, name) for name, bound in FULLNESS_BUCKETS),
        else_=FULL_BUCKET,
    )
    counts = session.execute(
        select(bucket, func.count(Gpu.id))
        .join(Host, Host.id == Gpu.host_id)
        .where(Host.retired_at.is_(None))
        .group_by(bucket)
    ).all()
    fullness = {name: 0 for name, _ in FULLNESS_BUCKETS} | {FULL_BUCKET: 0, UNKNOWN_BUCKET: 0}
    fullness.update({name: count for name, count in counts})
    return fullness


def held_bytes(*, session: Session) -> dict[str, int]:
    """Memory held by open ``orphaned`` and by open ``idle`` events, by kind (both
    present). Retiring a host ends its events, but events of retired hosts are left
    out all the same: the fleet's figures never count a host that left it."""
    held = dict.fromkeys(HELD_KINDS, 0)
    held.update(
        (kind, int(total or 0))
        for kind, total in session.execute(
            select(Event.kind, func.sum(Event.held_bytes))
            .join(Host, Host.id == Event.host_id)
            .where(Event.ended_at.is_(None), Event.kind.in_(HELD_KINDS), Host.retired_at.is_(None))
            .group_by(Event.kind)
        )
    )
    return held


def fleet_summary(
    *, session: Session, settings: ServerSettings, now: float, top: int = TOP_IDLE
) -> FleetOut:
    """Aggregated in SQL: a handful of grouped queries whatever the history size."""
    fullness = gpus_by_fullness(session=session, settings=settings, now=now)
    held = held_bytes(session=session)
    top_idle = session.execute(
        select(Event, Host.hostname)
        .join(Host, Host.id == Event.host_id)
        .where(Event.ended_at.is_(None), Event.kind == "idle", Host.retired_at.is_(None))
        .order_by(Event.held_bytes.desc().nulls_last(), Event.id)
        .limit(top)
    ).all()
    silent = session.scalars(
        select(Host.hostname)
        .where(
            Host.last_received_at.is_(None) | (Host.last_received_at < silent_before(settings, now))
        )
        .where(Host.retired_at.is_(None))
        .order_by(bytewise(Host.hostname))
    ).all()
    return FleetOut(
        generated_at=now,
        hosts=session.scalar(select(func.count(Host.id)).where(Host.retired_at.is_(None))) or 0,
        gpus=sum(fullness.values()),
        gpus_by_fullness=fullness,
        orphaned_bytes=held["orphaned"],
        idle_bytes=held["idle"],
        top_idle=[event_service.to_out(event, hostname) for event, hostname in top_idle],
        silent_hosts=list(silent),
    )
