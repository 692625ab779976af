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
from gpuwatch.server.hosts.models import Gpu, GpuWindow, Host
from gpuwatch.server.hosts.service import silence_threshold_seconds
from gpuwatch.server.processes import window
from gpuwatch.server.processes.models import ProcessLifetime
from gpuwatch.settings import ServerSettings

# Event kinds the rules read; the others (points, history) are not states to alert on.
ALERTED_KINDS = ("orphaned", "runaway", "idle", "filling_up", "gpu_lost", "agent_silent")


@dataclass(frozen=True)
class Holder:
    """A process holding memory on a GPU now (an open lifetime).

    ``lifetime_id`` and ``first_seen_at`` (epoch seconds) say which process it is: a PID
    alone does not, once the kernel hands it to another process. None where unknown
    (facts built by hand)."""

    pid: int
    user: str | None
    command: str | None
    memory_bytes: int | None
    container_id: str | None = None
    pod_uid: str | None = None
    slurm_job_id: str | None = None
    lifetime_id: int | None = None
    first_seen_at: float | None = None


@dataclass(frozen=True)
class GpuHealth:
    """What NVML last said of the GPU's health (None: it could not say)."""

    ecc_uncorrected_volatile: int | None = None
    xid_errors: int | None = None
    xid_last_code: int | None = None
    xid_seen_at: float | None = None
    throttle_reasons: frozenset[str] = frozenset()
    remap_pending: bool | None = None
    remap_failure: bool | None = None


@dataclass(frozen=True)
class GpuFact:
    hostname: str
    gpu: int
    total_bytes: int | None
    used_bytes: int | None
    unattributed_bytes: int | None
    # False when the host is silent or retired, or the GPU lost or unreadable: its
    # figures are stale.
    current: bool
    holders: tuple[Holder, ...] = ()
    # The lowest used memory over the lookback (from the GPU's recent window), read for
    # GPUs above ``holders_above`` only: how far a GPU that is full now has jumped.
    lowest_recent_bytes: int | None = None
    health: GpuHealth | None = None

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
    # When the event was last observed, with the evidence it carries (epoch seconds).
    seen_at: float | None = None


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
    # ``reaped`` point events of the announcement window, newest last.
    reaped: list[EventFact] = field(default_factory=list)
    # What cannot be seen now: ``(hostname, None)`` for a silent host, ``(hostname,
    # gpu)`` for a GPU that is lost or unreadable (a retired host is neither: it is
    # gone). A rule finds nothing there, and that is not news that its condition ended.
    unseen: frozenset[tuple[str, int | None]] = frozenset()

    def sees(self, labels: dict[str, str]) -> bool:
        """Whether the host and GPU an alert's ``labels`` name can be seen now."""
        hostname = labels.get("hostname", "")
        if (hostname, None) in self.unseen:
            return False
        gpu = labels.get("gpu")
        return gpu is None or not gpu.isdigit() or (hostname, int(gpu)) not in self.unseen


def read_facts(
    *,
    session: Session,
    settings: ServerSettings,
    now: float,
    ended_since: float | None,
    holders_above: float = 0.0,
    lookback_seconds: float = 900.0,
    reaped_since: float | None = None,
    up_since: float | None = None,
) -> Facts:
    """The fleet as the rules see it at ``now``; ended lifetimes only when
    ``ended_since`` is given (the job_ended rule is on).

    A host's figures are stale (``GpuFact.current`` False) once it has been silent for
    its threshold, counted from when this server started (``up_since``) at the
    earliest, as ``agent_silent`` counts it: while the server was down its agents spooled,
    and before their first push after a restart every alert on their figures resolved
    and fired again as a new one (a filling-up warning, an ECC alert). Such a host, and
    a GPU lost or unreadable, is listed in ``Facts.unseen``; a retired host is not.

    Holders (open lifetimes) are read only for the GPUs a rule can name them on: those
    with an open filling-up or idle event, and those at or above ``holders_above``
    used; on a large fleet that is a small share of every open lifetime.
    """
    gpu_rows = session.execute(
        select(
            Gpu.id,
            Gpu.host_id,
            Gpu.gpu_index,
            Gpu.memory_total_bytes,
            Gpu.memory_used_bytes,
            Gpu.unattributed_bytes,
            Gpu.lost,
            Gpu.read_error,
            Host.hostname,
            Host.last_received_at,
            Host.push_interval_seconds,
            Host.retired_at,
            Gpu.ecc_uncorrected_volatile,
            Gpu.xid_errors,
            Gpu.xid_last_code,
            Gpu.xid_seen_at,
            Gpu.throttle_reasons,
            Gpu.remap_pending,
            Gpu.remap_failure,
        ).join(Host, Host.id == Gpu.host_id)
    ).all()
    event_rows = session.execute(
        select(
            Event.kind,
            Event.reason,
            Event.host_id,
            Host.hostname,
            Event.gpu_index,
            Event.pid,
            Event.user,
            Event.held_bytes,
            Event.started_at,
            Event.summary,
            Event.evidence,
            Event.lifetime_id,
            Event.last_seen_at,
        )
        .join(Host, Host.id == Event.host_id)
        .where(Event.ended_at.is_(None), Event.kind.in_(ALERTED_KINDS))
    ).all()
    silent = {
        row.hostname
        for row in session.execute(
            select(Host.hostname, Host.last_received_at, Host.push_interval_seconds).where(
                Host.retired_at.is_(None)
            )
        )
        if not _fresh(row, settings, now=now, up_since=up_since)
    }
    gpu_ids = {(row.host_id, row.gpu_index): row.id for row in gpu_rows}
    wanted = {
        gpu_ids[(e.host_id, e.gpu_index)]
        for e in event_rows
        if e.kind in _NAMED_ON_GPU and (e.host_id, e.gpu_index) in gpu_ids
    }
    wanted |= {
        row.id
        for row in gpu_rows
        if row.memory_total_bytes
        and row.memory_used_bytes is not None
        and row.memory_used_bytes / row.memory_total_bytes >= holders_above
    }
    holders, by_lifetime = _holders(
        session, wanted, [e.lifetime_id for e in event_rows if e.lifetime_id is not None]
    )
    full = [
        row.id
        for row in gpu_rows
        if row.memory_total_bytes
        and row.memory_used_bytes is not None
        and row.memory_used_bytes / row.memory_total_bytes >= holders_above
    ]
    lowest = _lowest_recent(session, full, since=now - lookback_seconds)
    # Lost or unreadable: the row keeps the last figures read (ingest/apply.py).
    unreadable = {
        (row.hostname, row.gpu_index)
        for row in gpu_rows
        if (row.lost or row.read_error is not None) and row.retired_at is None
    }
    gpus = [
        GpuFact(
            hostname=row.hostname,
            gpu=row.gpu_index,
            total_bytes=row.memory_total_bytes,
            used_bytes=row.memory_used_bytes,
            unattributed_bytes=row.unattributed_bytes,
            current=row.retired_at is None
            and row.hostname not in silent
            and (row.hostname, row.gpu_index) not in unreadable,
            holders=tuple(sorted(holders.get(row.id, []), key=lambda h: -(h.memory_bytes or 0))),
            lowest_recent_bytes=lowest.get(row.id),
            health=_health(row),
        )
        for row in gpu_rows
    ]
    events = [
        EventFact(
            kind=e.kind,
            reason=e.reason,
            hostname=e.hostname,
            gpu=e.gpu_index,
            pid=e.pid,
            user=e.user,
            held_bytes=e.held_bytes,
            started_at=e.started_at,
            summary=e.summary,
            evidence=e.evidence or {},
            holder=None if e.lifetime_id is None else by_lifetime.get(e.lifetime_id),
            seen_at=e.last_seen_at,
        )
        for e in event_rows
    ]
    ended = [] if ended_since is None else _ended(session, ended_since)
    reaped = [] if reaped_since is None else _reaped(session, reaped_since)
    unseen = frozenset({(hostname, None) for hostname in silent} | unreadable)
    return Facts(gpus=gpus, events=events, ended=ended, reaped=reaped, unseen=unseen)


def _reaped(session: Session, since: float) -> list[EventFact]:
    rows = session.execute(
        select(Event, Host.hostname)
        .join(Host, Host.id == Event.host_id)
        .where(Event.kind == "reaped", Event.started_at >= since)
        .order_by(Event.started_at, Event.id)
    )
    return [
        EventFact(
            kind=e.kind,
            reason=e.reason,
            hostname=hostname,
            gpu=e.gpu_index,
            pid=e.pid,
            user=e.user,
            held_bytes=e.held_bytes,
            started_at=e.started_at,
            summary=e.summary,
            evidence=e.evidence or {},
        )
        for e, hostname in rows
    ]


# Events whose rules name every holder of their GPU (culprits, contention).
_NAMED_ON_GPU = ("filling_up", "idle")
_CHUNK = 500  # ids per IN list: within every database's parameter limit


def _fresh(row: Any, settings: ServerSettings, *, now: float, up_since: float | None) -> bool:
    """Whether the host behind ``row`` has pushed within its silence threshold, or this
    server has not been up that long (its silence may be the server's own outage)."""
    threshold = silence_threshold_seconds(settings, row.push_interval_seconds)
    if up_since is not None and now - up_since < threshold:
        return True
    return (row.last_received_at or 0.0) >= now - threshold


def _health(row: Any) -> GpuHealth:
    return GpuHealth(
        ecc_uncorrected_volatile=row.ecc_uncorrected_volatile,
        xid_errors=row.xid_errors,
        xid_last_code=row.xid_last_code,
        xid_seen_at=row.xid_seen_at,
        throttle_reasons=frozenset(filter(None, (row.throttle_reasons or "").split(","))),
        remap_pending=row.remap_pending,
        remap_failure=row.remap_failure,
    )


def _lowest_recent(session: Session, gpu_ids: list[int], *, since: float) -> dict[int, int]:
    """The lowest bucket floor of each GPU's recent window since ``since``."""
    lowest: dict[int, int] = {}
    for start in range(0, len(gpu_ids), _CHUNK):
        chunk = gpu_ids[start : start + _CHUNK]
        for gpu_id, blob in session.execute(
            select(GpuWindow.gpu_id, GpuWindow.recent_window).where(GpuWindow.gpu_id.in_(chunk))
        ):
            floor = window.floor_since(blob, since)
            if floor is not None:
                lowest[gpu_id] = floor
    return lowest


def _holders(
    session: Session, gpu_ids: set[int], lifetime_ids: list[int]
) -> tuple[dict[int, list[Holder]], dict[int, Holder]]:
    """Open lifetimes on ``gpu_ids`` (by GPU) and the lifetimes ``lifetime_ids``."""
    columns = (
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
        ProcessLifetime.first_seen_at,
    )
    by_gpu: dict[int, list[Holder]] = {}
    by_lifetime: dict[int, Holder] = {}
    ordered = sorted(gpu_ids)
    for start in range(0, len(ordered), _CHUNK):
        chunk = ordered[start : start + _CHUNK]
        for row in session.execute(
            select(*columns).where(
                ProcessLifetime.ended_at.is_(None), ProcessLifetime.gpu_id.in_(chunk)
            )
        ):
            holder = _holder(row[2:10], lifetime_id=row.id, first_seen_at=row.first_seen_at)
            by_gpu.setdefault(row.gpu_id, []).append(holder)
            by_lifetime[row.id] = holder
    missing = sorted(set(lifetime_ids) - set(by_lifetime))
    for start in range(0, len(missing), _CHUNK):
        for row in session.execute(
            select(*columns).where(ProcessLifetime.id.in_(missing[start : start + _CHUNK]))
        ):
            by_lifetime[row.id] = _holder(
                row[2:10], lifetime_id=row.id, first_seen_at=row.first_seen_at
            )
    return by_gpu, by_lifetime


def _holder(
    values: Any, *, lifetime_id: int | None = None, first_seen_at: float | None = None
) -> Holder:
    pid, user, command, name, memory, container_id, pod_uid, slurm_job_id = values
    return Holder(
        pid=pid,
        user=user,
        command=command or name,
        memory_bytes=memory,
        container_id=container_id,
        pod_uid=pod_uid,
        slurm_job_id=slurm_job_id,
        lifetime_id=lifetime_id,
        first_seen_at=first_seen_at,
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
