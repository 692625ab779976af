"""What the rules read: the fleet's current state, in a few queries per evaluation.

Everything is read in one transaction and handed to the pure rules as plain values,
so :mod:`rules` never touches the database and tests can build facts by hand.
Times are Unix epoch seconds; sizes bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from gpuwatch.server.events.models import Event
from gpuwatch.server.hosts.models import Gpu, Host
from gpuwatch.server.hosts.service import silence_threshold_seconds
from gpuwatch.server.processes.models import ProcessLifetime
from gpuwatch.settings import ServerSettings

# Event kinds the rules read; the others (points, history) are not states to alert on.
ALERTED_KINDS = ("orphaned", "runaway", "idle", "filling_up", "gpu_lost", "agent_silent")


@dataclass(frozen=True)
class Holder:
    """A process holding memory on a GPU now (an open lifetime)."""

    pid: int
    user: str | None
    command: str | None
    memory_bytes: int | None
    container_id: str | None = None
    pod_uid: str | None = None
    slurm_job_id: str | None = None


@dataclass(frozen=True)
class GpuFact:
    hostname: str
    gpu: int
    total_bytes: int | None
    used_bytes: int | None
    unattributed_bytes: int | None
    # False when the host is silent or the GPU unreadable: its figures are stale.
    current: bool
    holders: tuple[Holder, ...] = ()

    @property
    def used_ratio(self) -> float | None:
        if not self.total_bytes or self.used_bytes is None or not self.current:
            return None
        return self.used_bytes / self.total_bytes


@dataclass(frozen=True)
class EventFact:
    kind: str
    reason: str
    hostname: str
    gpu: int | None
    pid: int | None
    user: str | None
    held_bytes: int | None
    started_at: float
    summary: str
    evidence: dict[str, Any]
    holder: Holder | None = None


@dataclass(frozen=True)
class EndedProcess:
    """A process lifetime that ended recently (for the opt-in ``job_ended`` rule)."""

    hostname: str
    gpu: int
    holder: Holder
    first_seen_at: float
    ended_at: float
    peak_bytes: int | None
    busy: bool


@dataclass(frozen=True)
class Facts:
    gpus: list[GpuFact] = field(default_factory=list)
    events: list[EventFact] = field(default_factory=list)
    ended: list[EndedProcess] = field(default_factory=list)


def read_facts(
    *, session: Session, settings: ServerSettings, now: float, ended_since: float | None
) -> Facts:
    """The fleet as the rules see it at ``now``; ended lifetimes only when
    ``ended_since`` is given (the job_ended rule is on)."""
    reporting_since = now - silence_threshold_seconds(settings)
    holders: dict[int, list[Holder]] = {}
    by_lifetime: dict[int, Holder] = {}
    for row in session.execute(
        select(
            ProcessLifetime.id,
            ProcessLifetime.gpu_id,
            ProcessLifetime.pid,
            ProcessLifetime.user,
            ProcessLifetime.command,
            ProcessLifetime.name,
            ProcessLifetime.current_bytes,
            ProcessLifetime.container_id,
            ProcessLifetime.pod_uid,
            ProcessLifetime.slurm_job_id,
        ).where(ProcessLifetime.ended_at.is_(None))
    ):
        holder = _holder(row[2:])
        holders.setdefault(row.gpu_id, []).append(holder)
        by_lifetime[row.id] = holder
    gpus = [
        GpuFact(
            hostname=hostname,
            gpu=gpu.gpu_index,
            total_bytes=gpu.memory_total_bytes,
            used_bytes=gpu.memory_used_bytes,
            unattributed_bytes=gpu.unattributed_bytes,
            current=(received or 0.0) >= reporting_since and not gpu.lost,
            holders=tuple(sorted(holders.get(gpu.id, []), key=lambda h: -(h.memory_bytes or 0))),
        )
        for gpu, hostname, received in session.execute(
            select(Gpu, Host.hostname, Host.last_received_at).join(Host, Host.id == Gpu.host_id)
        )
    ]
    events = [
        EventFact(
            kind=event.kind,
            reason=event.reason,
            hostname=hostname,
            gpu=event.gpu_index,
            pid=event.pid,
            user=event.user,
            held_bytes=event.held_bytes,
            started_at=event.started_at,
            summary=event.summary,
            evidence=event.evidence or {},
            holder=None if event.lifetime_id is None else by_lifetime.get(event.lifetime_id),
        )
        for event, hostname in session.execute(
            select(Event, Host.hostname)
            .join(Host, Host.id == Event.host_id)
            .where(Event.ended_at.is_(None), Event.kind.in_(ALERTED_KINDS))
        )
    ]
    ended = [] if ended_since is None else _ended(session, ended_since)
    return Facts(gpus=gpus, events=events, ended=ended)


def _holder(values: Any) -> Holder:
    pid, user, command, name, memory, container_id, pod_uid, slurm_job_id = values
    return Holder(
        pid=pid,
        user=user,
        command=command or name,
        memory_bytes=memory,
        container_id=container_id,
        pod_uid=pod_uid,
        slurm_job_id=slurm_job_id,
    )


def _ended(session: Session, since: float) -> list[EndedProcess]:
    rows = session.execute(
        select(
            Host.hostname,
            Gpu.gpu_index,
            ProcessLifetime.pid,
            ProcessLifetime.user,
            ProcessLifetime.command,
            ProcessLifetime.name,
            ProcessLifetime.peak_bytes,
            ProcessLifetime.container_id,
            ProcessLifetime.pod_uid,
            ProcessLifetime.slurm_job_id,
            ProcessLifetime.first_seen_at,
            ProcessLifetime.ended_at,
            ProcessLifetime.sm_ratio,
            ProcessLifetime.idle_since,
        )
        .join(Gpu, Gpu.id == ProcessLifetime.gpu_id)
        .join(Host, Host.id == ProcessLifetime.host_id)
        .where(ProcessLifetime.ended_at >= since)
    ).all()
    ended = []
    for row in rows:
        holder = _holder((row[2], row[3], row[4], row[5], row[6], row[7], row[8], row[9]))
        # Busy at its end: SM activity at its last sighting, or idle only briefly.
        busy = bool(row.sm_ratio) or (
            row.idle_since is not None and row.ended_at - row.idle_since < 300
        )
        ended.append(
            EndedProcess(
                hostname=row.hostname,
                gpu=row.gpu_index,
                holder=holder,
                first_seen_at=row.first_seen_at,
                ended_at=row.ended_at,
                peak_bytes=row.peak_bytes,
                busy=busy,
            )
        )
    return ended
