"""One host's mutable state during an ingest request: loaded once, written back once.

Ingest is the hot path (hundreds of snapshots a second), and per-object ORM costs
about 15x what Core does on it (docs: performance-anchors.md, §7.2), so this module
reads plain column tuples into small dataclasses and writes them back with Core
``executemany``: per request, one UPDATE per table plus one INSERT per sample table,
however many snapshots the request carried. The typed models stay the schema's source.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields
from typing import Any, TypeVar

from sqlalchemy import Table, bindparam, insert, select, update
from sqlalchemy.orm import Session

from gpuwatch.server.database.dialects import insert_ignoring_conflicts
from gpuwatch.server.detectors import Sample
from gpuwatch.server.events.book import EventBook
from gpuwatch.server.hosts.models import Gpu, GpuSample, Host
from gpuwatch.server.processes.models import ProcessLifetime, ProcessSample

_HOSTS: Table = Host.__table__  # type: ignore[assignment]
_GPUS: Table = Gpu.__table__  # type: ignore[assignment]
_LIFETIMES: Table = ProcessLifetime.__table__  # type: ignore[assignment]
_PROCESS_SAMPLES: Table = ProcessSample.__table__  # type: ignore[assignment]
_GPU_SAMPLES: Table = GpuSample.__table__  # type: ignore[assignment]

# Identity of a lifetime within its host: (gpu row id, pid, process start time).
Identity = tuple[int, int, float | None]


@dataclass(eq=False)
class HostRow:
    id: int
    hostname: str
    agent_id: str | None
    boot_id: str | None
    last_sequence: int | None
    last_seen_at: float | None
    last_received_at: float | None
    driver_version: str | None
    cuda_driver_version: str | None
    pid_namespace_isolated: bool
    fake: bool
    spool_dropped_total: int


@dataclass(eq=False)
class GpuRow:
    id: int
    uuid: str
    gpu_index: int
    name: str | None
    memory_total_bytes: int | None
    memory_used_bytes: int | None
    memory_free_bytes: int | None
    unattributed_bytes: int | None
    utilization_ratio: float | None
    lost: bool
    read_error: str | None
    last_seen_at: float
    bucket_start_at: float | None
    bucket_used_bytes: int | None
    bucket_unattributed_bytes: int | None


@dataclass(eq=False)
class LifetimeRow:
    id: int
    gpu_id: int
    pid: int
    start_time: float | None
    kind: str
    name: str | None
    command: str | None
    user: str | None
    uid: int | None
    container_id: str | None
    pod_uid: str | None
    slurm_job_id: str | None
    orphaned: bool
    first_seen_at: float
    last_seen_at: float
    ended_at: float | None
    current_bytes: int | None
    peak_bytes: int | None
    sm_ratio: float | None
    idle_since: float | None
    bucket_start_at: float | None
    bucket_min_bytes: int | None
    bucket_max_bytes: int | None
    bucket_max_sm_ratio: float | None

    @property
    def identity(self) -> Identity:
        return (self.gpu_id, self.pid, self.start_time)


R = TypeVar("R", HostRow, GpuRow, LifetimeRow)


class HostState:
    """The rows of one host that ingest changes, plus the samples it produced.

    Callers mutate the rows in place and call :meth:`touch` on the ones they changed;
    :meth:`flush` writes exactly those. Samples the request produced are kept in
    :attr:`recent` too, so detectors see them before they are written.
    """

    def __init__(
        self,
        *,
        session: Session,
        dialect: str,
        host: HostRow,
        gpus: list[GpuRow],
        lifetimes: list[LifetimeRow],
        events: EventBook,
    ) -> None:
        self.session = session
        self.dialect = dialect
        self.host = host
        self.gpus = {gpu.uuid: gpu for gpu in gpus}
        self.open = {lt.identity: lt for lt in lifetimes}
        self.events = events
        self._dirty_gpus: dict[int, GpuRow] = {}
        self._dirty_lifetimes: dict[int, LifetimeRow] = {}
        self._process_samples: list[dict[str, Any]] = []
        self._gpu_samples: list[dict[str, Any]] = []
        self.recent: dict[int, list[Sample]] = {}

    @classmethod
    def load(cls, *, session: Session, dialect: str, host_id: int) -> HostState:
        """Lock the host row (Postgres: ``FOR UPDATE``, which serialises concurrent
        requests of one host; SQLite's ``BEGIN IMMEDIATE`` already serialises all
        writers) and read its GPUs, open lifetimes and open events."""
        host = _read(session, HostRow, _HOSTS, _HOSTS.c.id == host_id, for_update=True)[0]
        gpus = _read(session, GpuRow, _GPUS, _GPUS.c.host_id == host_id)
        lifetimes = _read(
            session,
            LifetimeRow,
            _LIFETIMES,
            (_LIFETIMES.c.host_id == host_id) & _LIFETIMES.c.ended_at.is_(None),
        )
        events = EventBook.load(session=session, host_id=host_id)
        return cls(
            session=session,
            dialect=dialect,
            host=host,
            gpus=gpus,
            lifetimes=lifetimes,
            events=events,
        )

    def touch(self, row: GpuRow | LifetimeRow) -> None:
        if isinstance(row, GpuRow):
            self._dirty_gpus[row.id] = row
        else:
            self._dirty_lifetimes[row.id] = row

    def add_gpu(self, values: dict[str, Any]) -> GpuRow:
        """Insert a GPU seen for the first time (its id is needed at once)."""
        gpu_id = self.session.execute(
            insert(_GPUS).values(host_id=self.host.id, **values).returning(_GPUS.c.id)
        ).scalar_one()
        gpu = GpuRow(id=gpu_id, **values)
        self.gpus[gpu.uuid] = gpu
        return gpu

    def closed_matches(self, identities: Iterable[Identity]) -> list[LifetimeRow]:
        """Closed lifetimes of this host with one of these PIDs on one of these GPUs."""
        wanted = list(identities)
        if not wanted:
            return []
        return _read(
            self.session,
            LifetimeRow,
            _LIFETIMES,
            (_LIFETIMES.c.host_id == self.host.id)
            & _LIFETIMES.c.ended_at.is_not(None)
            & _LIFETIMES.c.gpu_id.in_({gpu_id for gpu_id, _, _ in wanted})
            & _LIFETIMES.c.pid.in_({pid for _, pid, _ in wanted}),
        )

    def add_lifetimes(self, values: Sequence[dict[str, Any]]) -> list[LifetimeRow]:
        """Insert new lifetimes in one statement, returning them with their ids."""
        if not values:
            return []
        ids = self.session.execute(
            insert(_LIFETIMES).returning(_LIFETIMES.c.id, sort_by_parameter_order=True),
            [{"host_id": self.host.id, **row} for row in values],
        ).scalars()
        created = [LifetimeRow(id=lt_id, **row) for lt_id, row in zip(ids, values, strict=True)]
        for lifetime in created:
            self.open[lifetime.identity] = lifetime
        return created

    def add_process_sample(self, lifetime: LifetimeRow) -> None:
        """Close the lifetime's current bucket into a sample row."""
        assert lifetime.bucket_start_at is not None
        self._process_samples.append(
            {
                "lifetime_id": lifetime.id,
                "t": lifetime.bucket_start_at,
                "used_bytes": lifetime.bucket_min_bytes,
                "peak_bytes": lifetime.bucket_max_bytes,
                "sm_ratio": lifetime.bucket_max_sm_ratio,
            }
        )
        # Detectors see the bucket's floor (leak) and its busiest poll (idle).
        recent = self.recent.get(lifetime.id)
        if recent is not None:
            recent.append(
                Sample(
                    t=lifetime.bucket_start_at,
                    used_bytes=lifetime.bucket_min_bytes,
                    sm_ratio=lifetime.bucket_max_sm_ratio,
                )
            )

    def add_gpu_sample(self, gpu: GpuRow) -> None:
        assert gpu.bucket_start_at is not None
        self._gpu_samples.append(
            {
                "gpu_id": gpu.id,
                "t": gpu.bucket_start_at,
                "used_bytes": gpu.bucket_used_bytes,
                "total_bytes": gpu.memory_total_bytes,
                "unattributed_bytes": gpu.bucket_unattributed_bytes,
            }
        )

    def load_recent(self, lifetime_ids: Iterable[int], *, since: float) -> None:
        """Make :attr:`recent` hold the stored samples since ``since`` for these ids.

        Called before their first detector run in this request; samples this request
        produced later are appended by :meth:`add_process_sample`.
        """
        missing = [lt_id for lt_id in lifetime_ids if lt_id not in self.recent]
        if not missing:
            return
        for lt_id in missing:
            self.recent[lt_id] = []
        rows = self.session.execute(
            select(
                _PROCESS_SAMPLES.c.lifetime_id,
                _PROCESS_SAMPLES.c.t,
                _PROCESS_SAMPLES.c.used_bytes,
                _PROCESS_SAMPLES.c.sm_ratio,
            )
            .where(_PROCESS_SAMPLES.c.lifetime_id.in_(missing), _PROCESS_SAMPLES.c.t >= since)
            .order_by(_PROCESS_SAMPLES.c.t)
        )
        for lt_id, t, used, sm in rows:
            self.recent[lt_id].append(Sample(t=t, used_bytes=used, sm_ratio=sm))
        # Samples already produced by this request (before the first load) count too.
        for row in self._process_samples:
            if row["lifetime_id"] in missing and row["t"] >= since:
                self.recent[row["lifetime_id"]].append(
                    Sample(t=row["t"], used_bytes=row["used_bytes"], sm_ratio=row["sm_ratio"])
                )

    def flush(self) -> None:
        """Write every touched row and every produced sample."""
        _write(self.session, _HOSTS, [self.host])
        _write(self.session, _GPUS, list(self._dirty_gpus.values()))
        _write(self.session, _LIFETIMES, list(self._dirty_lifetimes.values()))
        for table, rows in (
            (_PROCESS_SAMPLES, self._process_samples),
            (_GPU_SAMPLES, self._gpu_samples),
        ):
            if rows:
                # A lifetime that closes and reopens within one interval closes the
                # same bucket twice; the first row stands.
                self.session.execute(insert_ignoring_conflicts(table, self.dialect), rows)
        self.events.flush(session=self.session)


def _read(
    session: Session, cls: type[R], table: Table, where: Any, *, for_update: bool = False
) -> list[R]:
    names = [f.name for f in fields(cls)]
    query = select(*(table.c[name] for name in names)).where(where)
    if for_update:
        query = query.with_for_update()
    return [cls(*row) for row in session.execute(query)]


def _write(session: Session, table: Table, rows: Sequence[HostRow | GpuRow | LifetimeRow]) -> None:
    if not rows:
        return
    names = [f.name for f in fields(rows[0]) if f.name != "id"]
    session.execute(
        update(table)
        .where(table.c.id == bindparam("row_id"))
        .values({name: bindparam(name) for name in names}),
        [{"row_id": row.id, **{name: getattr(row, name) for name in names}} for row in rows],
    )
