"""One host's mutable state during an ingest request: loaded once, written back once.

Ingest is the hot path (hundreds of snapshots a second), and per-object ORM costs
about 15x what Core does on it (docs: performance-anchors.md, §7.2), so this module
reads plain column tuples into small dataclasses and writes them back with driver
``executemany`` (:class:`~gpuwatch.server.database.bulk.BulkStatement`; on Postgres one
statement over arrays instead): per request, one UPDATE per table plus one INSERT per
sample table, however many snapshots the request carried. The typed models stay the
schema's source.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields
from functools import cache, partial
from operator import attrgetter
from typing import Any

from sqlalchemy import Executable, Select, Table, bindparam, insert, select, update
from sqlalchemy.orm import Session

from gpuwatch.detectors import Sample
from gpuwatch.server.database.bulk import BulkStatement
from gpuwatch.server.database.dialects import (
    insert_ignoring_conflicts,
    unnest_insert,
    unnest_update,
    upsert,
)
from gpuwatch.server.events.book import EventBook
from gpuwatch.server.hosts.models import (
    GPU_FLAG_KINDS,
    Gpu,
    GpuIndex,
    GpuSample,
    GpuWindow,
    Host,
)
from gpuwatch.server.hosts.tiles import tiles_text
from gpuwatch.server.ingest.cache import HostStateCache, KeptState
from gpuwatch.server.processes.models import ProcessLifetime, ProcessSample, ProcessWindow

_HOSTS: Table = Host.__table__  # type: ignore[assignment]
_GPUS: Table = Gpu.__table__  # type: ignore[assignment]
_GPU_INDICES: Table = GpuIndex.__table__  # type: ignore[assignment]
_LIFETIMES: Table = ProcessLifetime.__table__  # type: ignore[assignment]
_PROCESS_SAMPLES: Table = ProcessSample.__table__  # type: ignore[assignment]
_GPU_SAMPLES: Table = GpuSample.__table__  # type: ignore[assignment]
_WINDOWS: Table = ProcessWindow.__table__  # type: ignore[assignment]
_GPU_WINDOWS: Table = GpuWindow.__table__  # type: ignore[assignment]

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
    state_version: int
    tiles: str | None
    push_interval_seconds: float | None


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
    bucket_low_bytes: int | None
    unattributed_since: float | None
    ecc_uncorrected_volatile: int | None
    xid_errors: int | None
    xid_last_code: int | None
    xid_seen_at: float | None
    throttle_reasons: str | None
    remap_pending: bool | None
    remap_failure: bool | None
    # Who holds memory on the GPU: refilled from the open lifetimes on every flush
    # (:meth:`HostState.refill_holders`); a new GPU starts with nobody.
    holder_user: str | None = None
    holder_bytes: int | None = None
    holder_processes: int = 0
    holder_users: int = 0
    # The host's open events on this GPU's index, as a mask of GPU_FLAG_KINDS: refilled
    # from the event book on every flush (:meth:`HostState.refill_flags`).
    open_flags: int = 0


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


class HostState:
    """The rows of one host that ingest changes, plus the samples it produced.

    Callers mutate the rows in place and call :meth:`touch` on the ones they changed;
    :meth:`flush` writes exactly those, and the samples the request produced.
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
        # Taken once: every statement below runs on it, and ``Session.connection()``
        # costs about as much as a small statement.
        self.connection = session.connection()
        self.dialect = dialect
        self.host = host
        self.gpus = {gpu.uuid: gpu for gpu in gpus}
        self.open = {lt.identity: lt for lt in lifetimes}
        # Lifetimes this request ended. Their end is written only by :meth:`flush`, so
        # until then the database still has them open and only this map knows them
        # closed: a process that comes back later in the same request (a missed poll,
        # a new boot id) must reopen this row, not insert a second one of the same
        # identity (the table's unique key).
        self.closed: dict[Identity, LifetimeRow] = {}
        # What each lifetime's rarely changing columns hold in the database now: flush
        # writes those columns only for the lifetimes whose values moved.
        self._stored_cold = {lt.id: _LIFETIME_COLD(lt) for lt in lifetimes}
        self.events = events
        self._dirty_gpus: dict[int, GpuRow] = {}
        self._dirty_lifetimes: dict[int, LifetimeRow] = {}
        self._process_samples: list[tuple[Any, ...]] = []
        self._gpu_samples: list[tuple[Any, ...]] = []
        self._windows: dict[int, bytes | None] = {}
        self._dirty_windows: set[int] = set()
        self._gpu_windows: dict[int, bytes | None] = {}
        self._dirty_gpu_windows: set[int] = set()

    @classmethod
    def load(
        cls,
        *,
        session: Session,
        dialect: str,
        host_id: int,
        cache: HostStateCache | None = None,
    ) -> HostState:
        """Lock the host row (Postgres: ``FOR UPDATE``, which serialises concurrent
        requests of one host; SQLite's ``BEGIN IMMEDIATE`` already serialises all
        writers) and read its GPUs, open lifetimes and open events, or take them from
        ``cache`` when its copy is at the host's current ``state_version``."""
        params = {"host_id": host_id}
        # On the connection: these are Core statements, and the ORM session's execution
        # path around them cost as much as the queries. ``all()`` fetches in one call.
        connection = session.connection()
        (host,) = [HostRow(*row) for row in connection.execute(_host_query(), params).all()]
        kept = cache.take(host_id, host.state_version) if cache is not None else None
        if kept is not None:
            state = cls(
                session=session,
                dialect=dialect,
                host=host,
                gpus=kept.gpus,
                lifetimes=kept.lifetimes,
                events=EventBook(host_id, kept.events),
            )
            state._windows.update(kept.windows)
            state._gpu_windows.update(kept.gpu_windows)
            return state
        gpus = [GpuRow(*row) for row in connection.execute(_gpus_query(), params).all()]
        lifetimes = [
            LifetimeRow(*row) for row in connection.execute(_lifetimes_query(), params).all()
        ]
        events = EventBook.load(session=session, host_id=host_id)
        return cls(
            session=session,
            dialect=dialect,
            host=host,
            gpus=gpus,
            lifetimes=lifetimes,
            events=events,
        )

    def kept(self) -> KeptState:
        """This state as :meth:`flush` wrote it, for :meth:`HostStateCache.put` once
        the transaction has committed."""
        return KeptState.of(
            self.host,
            list(self.gpus.values()),
            list(self.open.values()),
            self.events.open_rows(),
            self._windows,
            self._gpu_windows,
        )

    def touch(self, row: GpuRow | LifetimeRow) -> None:
        if isinstance(row, GpuRow):
            self._dirty_gpus[row.id] = row
        else:
            self._dirty_lifetimes[row.id] = row

    def add_gpu(self, values: dict[str, Any]) -> GpuRow:
        """Insert a GPU seen for the first time (its id is needed at once)."""
        gpu_id = self.connection.execute(
            insert(_GPUS).values(host_id=self.host.id, **values).returning(_GPUS.c.id)
        ).scalar_one()
        gpu = GpuRow(id=gpu_id, **values)
        self.gpus[gpu.uuid] = gpu
        return gpu

    def record_gpu_index(self, gpu: GpuRow, *, since: float) -> None:
        """Note that ``gpu`` has had its ``gpu_index`` since ``since`` (GpuIndex).
        Written at once: a GPU's index changes between boots only, so this is rare."""
        self.connection.execute(
            upsert(_GPU_INDICES, self.dialect, key=["gpu_id", "since"], columns=["gpu_index"]),
            {"gpu_id": gpu.id, "since": since, "gpu_index": gpu.gpu_index},
        )

    def end(self, lifetime: LifetimeRow, *, at: float) -> None:
        """Mark an open lifetime ended at ``at`` (written by :meth:`flush`)."""
        lifetime.ended_at = at
        self.open.pop(lifetime.identity, None)
        self.closed[lifetime.identity] = lifetime
        self.touch(lifetime)

    def reopen(self, lifetime: LifetimeRow) -> None:
        """Make a closed lifetime (from :meth:`closed_matches`) open again."""
        lifetime.ended_at = None
        self.closed.pop(lifetime.identity, None)
        self.open[lifetime.identity] = lifetime
        self.touch(lifetime)

    def closed_matches(self, identities: Iterable[Identity]) -> list[LifetimeRow]:
        """Closed lifetimes of this host with one of these PIDs on one of these GPUs:
        those this request ended (in memory, the truth until :meth:`flush`), then the
        database's, less any row this request already holds (its copy is newer)."""
        wanted = list(identities)
        if not wanted:
            return []
        here = [self.closed[identity] for identity in wanted if identity in self.closed]
        query = _select(LifetimeRow, _LIFETIMES).where(
            _LIFETIMES.c.host_id == self.host.id,
            _LIFETIMES.c.ended_at.is_not(None),
            _LIFETIMES.c.gpu_id.in_({gpu_id for gpu_id, _, _ in wanted}),
            _LIFETIMES.c.pid.in_({pid for _, pid, _ in wanted}),
        )
        held = {lt.id for lt in self.closed.values()} | {lt.id for lt in self.open.values()}
        stored = [LifetimeRow(*row) for row in self.connection.execute(query).all()]
        return here + [lt for lt in stored if lt.id not in held]

    def add_lifetimes(self, values: Sequence[dict[str, Any]]) -> list[LifetimeRow]:
        """Insert new lifetimes in one statement, returning them with their ids."""
        if not values:
            return []
        ids = self.connection.execute(
            insert(_LIFETIMES).returning(_LIFETIMES.c.id, sort_by_parameter_order=True),
            [{"host_id": self.host.id, **row} for row in values],
        ).scalars()
        created = [LifetimeRow(id=lt_id, **row) for lt_id, row in zip(ids, values, strict=True)]
        for lifetime in created:
            self.open[lifetime.identity] = lifetime
            self._stored_cold[lifetime.id] = _LIFETIME_COLD(lifetime)
        return created

    def add_process_sample(self, lifetime: LifetimeRow) -> Sample:
        """Close the lifetime's current bucket into a sample row; return it as the
        detectors see it (the bucket's floor and peak, and its busiest poll)."""
        assert lifetime.bucket_start_at is not None
        sample = Sample(
            t=lifetime.bucket_start_at,
            used_bytes=lifetime.bucket_min_bytes,
            sm_ratio=lifetime.bucket_max_sm_ratio,
            peak_bytes=lifetime.bucket_max_bytes,
        )
        self._process_samples.append(
            (lifetime.id, sample.t, sample.used_bytes, sample.peak_bytes, sample.sm_ratio)
        )
        return sample

    def add_gpu_sample(self, gpu: GpuRow) -> Sample:
        """Close the GPU's current bucket into a sample row; return it as the filling-up
        detector sees it (the bucket's lowest and highest used memory)."""
        assert gpu.bucket_start_at is not None
        self._gpu_samples.append(
            (
                gpu.id,
                gpu.bucket_start_at,
                gpu.bucket_used_bytes,
                gpu.memory_total_bytes,
                gpu.bucket_unattributed_bytes,
            )
        )
        return Sample(
            t=gpu.bucket_start_at,
            used_bytes=gpu.bucket_low_bytes,
            sm_ratio=None,
            peak_bytes=gpu.bucket_used_bytes,
        )

    def gpu_window(self, gpu_id: int) -> bytes | None:
        """The packed recent window of one GPU (read at most once per request)."""
        if gpu_id not in self._gpu_windows:
            row = self.connection.execute(_gpu_window_query(), {"gpu_id": gpu_id}).first()
            self._gpu_windows[gpu_id] = None if row is None else row[0]
        return self._gpu_windows[gpu_id]

    def set_gpu_window(self, gpu_id: int, blob: bytes) -> None:
        self._gpu_windows[gpu_id] = blob
        self._dirty_gpu_windows.add(gpu_id)

    def windows(self, lifetime_ids: Iterable[int]) -> dict[int, bytes | None]:
        """The packed recent windows of these lifetimes (read once per request)."""
        missing = [lt_id for lt_id in lifetime_ids if lt_id not in self._windows]
        if missing:
            rows = self.connection.execute(_windows_query(), {"ids": missing}).all()
            self._windows.update(dict.fromkeys(missing))  # no row yet: no samples yet
            self._windows.update({lt_id: blob for lt_id, blob in rows})
        return self._windows

    def set_window(self, lifetime_id: int, blob: bytes) -> None:
        self._windows[lifetime_id] = blob
        self._dirty_windows.add(lifetime_id)

    def refill_holders(self) -> None:
        """Set each GPU's ``holder_*`` from the open lifetimes as they are now, and
        touch the GPUs whose holders moved. Every change to which lifetimes are open
        (ingest, a reboot, the stale-lifetime job) is written by :meth:`flush`, which
        calls this, so the GPU rows never disagree with the lifetimes they summarise.
        The largest holder has the most bytes (unknown bytes count as fewest), then
        the oldest lifetime (lowest id); distinct users leave out an unknown owner."""
        # One pass over the host's open lifetimes (about 50): a few microseconds.
        found: dict[int, list[Any]] = {}
        for lifetime in self.open.values():
            held = found.get(lifetime.gpu_id)
            if held is None:
                found[lifetime.gpu_id] = [lifetime, 1, {lifetime.user}]
                continue
            held[1] += 1
            held[2].add(lifetime.user)
            top = held[0]
            size = -1 if lifetime.current_bytes is None else lifetime.current_bytes
            top_size = -1 if top.current_bytes is None else top.current_bytes
            if size > top_size or (size == top_size and lifetime.id < top.id):
                held[0] = lifetime
        for gpu in self.gpus.values():
            held = found.get(gpu.id)
            if held is None:
                holders: tuple[Any, ...] = _NOBODY
            else:
                top, count, users = held
                holders = (top.user, top.current_bytes, count, len(users) - (None in users))
            if _HOLDERS(gpu) != holders:
                gpu.holder_user, gpu.holder_bytes, gpu.holder_processes, gpu.holder_users = holders
                self._dirty_gpus[gpu.id] = gpu

    def refill_flags(self) -> None:
        """Set each GPU's ``open_flags`` from the host's open events as the event book
        holds them now (what its flush is about to write), and touch the GPUs whose
        flags moved. Every event that can set a flag is about a GPU or one of its
        processes and is written through this host state's book (ingest, the
        stale-lifetime job); the other writers of events write ``agent_silent`` (about
        the host) or point events (stored closed), which no flag shows. A flag belongs
        to the GPU's index, as the event names it."""
        masks: dict[int, int] = {}
        for event in self.events.open_rows():  # a handful per host
            bit = _FLAG_BITS.get(event.kind)
            if bit is not None and event.gpu_index is not None:
                masks[event.gpu_index] = masks.get(event.gpu_index, 0) | bit
        for gpu in self.gpus.values():
            flags = masks.get(gpu.gpu_index, 0)
            if gpu.open_flags != flags:
                gpu.open_flags = flags
                self._dirty_gpus[gpu.id] = gpu

    def flush(self) -> None:
        """Write every touched row, window and produced sample, and bump the host's
        ``state_version`` (which tells other processes their copies are stale)."""
        connection = self.connection
        self.refill_holders()
        self.refill_flags()
        # From the GPU rows as they are about to be written (the host row is written
        # on every flush anyway).
        self.host.tiles = tiles_text(self.gpus.values())
        self.host.state_version += 1
        _UPDATE_HOST.execute(connection, [_HOST_VALUES(self.host)])
        _UPDATE_GPUS.execute(connection, [_GPU_VALUES(row) for row in self._dirty_gpus.values()])
        hot, full = [], []
        for row in self._dirty_lifetimes.values():
            cold = _LIFETIME_COLD(row)
            if self._stored_cold.get(row.id) == cold:
                hot.append(_LIFETIME_HOT_VALUES(row))
            else:
                full.append(_LIFETIME_VALUES(row))
                self._stored_cold[row.id] = cold
        _UPDATE_LIFETIMES_HOT.execute(connection, hot)
        _UPDATE_LIFETIMES.execute(connection, full)
        _UPSERT_WINDOWS[self.dialect].execute(
            connection,
            [(lt_id, self._windows[lt_id]) for lt_id in self._dirty_windows],
        )
        _UPSERT_GPU_WINDOWS[self.dialect].execute(
            connection,
            [(gpu_id, self._gpu_windows[gpu_id]) for gpu_id in self._dirty_gpu_windows],
        )
        # A lifetime that closes and reopens within one interval closes the same
        # bucket twice; the first row stands.
        _INSERT_PROCESS_SAMPLES[self.dialect].execute(connection, self._process_samples)
        _INSERT_GPU_SAMPLES[self.dialect].execute(connection, self._gpu_samples)
        self.events.flush(session=self.session)


def lock_hosts(session: Session, host_ids: Iterable[int]) -> None:
    """Lock the rows of ``host_ids`` (Postgres: ``FOR UPDATE``) in id order, in one
    statement. A transaction that stores several hosts takes their locks here, before
    any of them, so two replicas' transactions over the same hosts cannot deadlock;
    :meth:`HostState.load` locking each again as it goes is then a no-op."""
    ids = sorted(set(host_ids))
    query = select(_HOSTS.c.id).where(_HOSTS.c.id.in_(ids)).order_by(_HOSTS.c.id)
    session.connection().execute(query.with_for_update()).all()


def _select(cls: type, table: Table) -> Select[Any]:
    return select(*(table.c[f.name] for f in fields(cls)))


# Built once: a reused statement object skips SQLAlchemy's cache-key generation.
@cache
def _host_query() -> Select[Any]:
    return _select(HostRow, _HOSTS).where(_HOSTS.c.id == bindparam("host_id")).with_for_update()


@cache
def _gpus_query() -> Select[Any]:
    return _select(GpuRow, _GPUS).where(_GPUS.c.host_id == bindparam("host_id"))


@cache
def _windows_query() -> Select[Any]:
    return select(_WINDOWS.c.lifetime_id, _WINDOWS.c.recent_window).where(
        _WINDOWS.c.lifetime_id.in_(bindparam("ids", expanding=True))
    )


@cache
def _gpu_window_query() -> Select[Any]:
    return select(_GPU_WINDOWS.c.recent_window).where(_GPU_WINDOWS.c.gpu_id == bindparam("gpu_id"))


@cache
def _lifetimes_query() -> Select[Any]:
    return _select(LifetimeRow, _LIFETIMES).where(
        _LIFETIMES.c.host_id == bindparam("host_id"), _LIFETIMES.c.ended_at.is_(None)
    )


# Set once at insert; leaving them out of UPDATE spares SQLite index maintenance.
_IMMUTABLE = {"id", "gpu_id", "pid", "start_time", "first_seen_at", "uuid", "hostname"}


def _columns(cls: type) -> list[str]:
    return [f.name for f in fields(cls) if f.name not in _IMMUTABLE]


def _update_by_id(table: Table, cls: type, names: Sequence[str] | None = None) -> BulkStatement:
    names = _columns(cls) if names is None else names

    def build() -> Executable:
        return (
            update(table)
            .where(table.c.id == bindparam("row_id"))
            .values({name: bindparam(name) for name in names})
        )

    params = [*names, "row_id"]
    return BulkStatement(
        build, params, postgres=partial(unnest_update, table, params, key="id", param="row_id")
    )


def _insert_ignoring(table: Table, names: Sequence[str]) -> dict[str, BulkStatement]:
    return {
        dialect: BulkStatement(
            partial(insert_ignoring_conflicts, table, dialect),
            names,
            postgres=partial(unnest_insert, table, names),
        )
        for dialect in ("sqlite", "postgresql")
    }


def _upsert(table: Table, key: str, column: str) -> dict[str, BulkStatement]:
    return {
        dialect: BulkStatement(
            partial(upsert, table, dialect, key=[key], columns=[column]),
            [key, column],
            postgres=partial(unnest_insert, table, [key, column], key=[key], update=[column]),
        )
        for dialect in ("sqlite", "postgresql")
    }


# Compiled on first use, once per dialect. Row tuples: the columns, then the id.
_UPDATE_HOST = _update_by_id(_HOSTS, HostRow)
_UPDATE_GPUS = _update_by_id(_GPUS, GpuRow)
_UPDATE_LIFETIMES = _update_by_id(_LIFETIMES, LifetimeRow)
_HOST_VALUES = attrgetter(*_columns(HostRow), "id")
_HOLDERS = attrgetter("holder_user", "holder_bytes", "holder_processes", "holder_users")
_NOBODY = (None, None, 0, 0)
_FLAG_BITS = {kind: 1 << bit for bit, kind in enumerate(GPU_FLAG_KINDS)}
_GPU_VALUES = attrgetter(*_columns(GpuRow), "id")
_LIFETIME_VALUES = attrgetter(*_columns(LifetimeRow), "id")
# What a snapshot of a running process changes. The other columns (owner, command,
# ended_at) rarely change, and two of them are indexed: SQLite rewrites the entries of
# every index whose columns an UPDATE sets, changed or not, so the every-snapshot
# UPDATE leaves them out.
_LIFETIME_HOT = [
    "orphaned",
    "last_seen_at",
    "current_bytes",
    "peak_bytes",
    "sm_ratio",
    "idle_since",
    "bucket_start_at",
    "bucket_min_bytes",
    "bucket_max_bytes",
    "bucket_max_sm_ratio",
]
_LIFETIME_COLD = attrgetter(*(name for name in _columns(LifetimeRow) if name not in _LIFETIME_HOT))
_UPDATE_LIFETIMES_HOT = _update_by_id(_LIFETIMES, LifetimeRow, _LIFETIME_HOT)
_LIFETIME_HOT_VALUES = attrgetter(*_LIFETIME_HOT, "id")
# A lifetime has no window row until its first bucket closes.
_UPSERT_WINDOWS = _upsert(_WINDOWS, "lifetime_id", "recent_window")
_UPSERT_GPU_WINDOWS = _upsert(_GPU_WINDOWS, "gpu_id", "recent_window")
_INSERT_PROCESS_SAMPLES = _insert_ignoring(
    _PROCESS_SAMPLES, ["lifetime_id", "t", "used_bytes", "peak_bytes", "sm_ratio"]
)
_INSERT_GPU_SAMPLES = _insert_ignoring(
    _GPU_SAMPLES, ["gpu_id", "t", "used_bytes", "total_bytes", "unattributed_bytes"]
)
