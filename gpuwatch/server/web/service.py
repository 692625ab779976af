"""The dashboard's own reads: the fleet's tiles and the memory history behind the charts.

Everything else the pages show comes from the domain services (hosts, events, alerts).
These two have no API counterpart, because they are shaped for drawing: every GPU of
the fleet with its holders and flags in two grouped queries (no query per host), and
a GPU's history already cut into the chart's columns in SQL, so a month of one-minute
samples arrives as a few hundred rows per process.

Sizes are bytes, times Unix epoch seconds (the agents' clocks, as stored), as in the
rest of the server.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Sequence
from typing import Any, NamedTuple

from sqlalchemy import (
    BigInteger,
    ColumnElement,
    Integer,
    Subquery,
    case,
    cast,
    func,
    literal,
    select,
)
from sqlalchemy.orm import InstrumentedAttribute, Session

from gpuwatch.server.alerts.models import AlertRow
from gpuwatch.server.events.models import Event
from gpuwatch.server.fleet.schemas import FULL_BUCKET, FULLNESS_BUCKETS, UNKNOWN_BUCKET
from gpuwatch.server.hosts.models import Gpu, GpuSample, Host
from gpuwatch.server.hosts.service import silence_threshold_seconds
from gpuwatch.server.processes.models import ProcessLifetime, ProcessSample
from gpuwatch.settings import ServerSettings

# Event kinds a tile flags (an open event of the kind on that GPU), in the order of the
# bits of a tile's flag mask: bit ``i`` set means an open ``TILE_FLAGS[i]`` event.
TILE_FLAGS = ("orphaned", "idle", "filling_up", "runaway", "gpu_lost")
# Processes drawn one by one in a chart; the rest are summed into one "other" layer.
MAX_LAYERS = 10
# Lifetimes read for one chart at most (the newest): a month of short jobs on one GPU.
MAX_LIFETIMES = 2000


class FleetHost(NamedTuple):
    """A host of the fleet page and its GPUs, each a tuple of :data:`TILE_COLUMNS`."""

    hostname: str
    silent: bool
    tiles: list[Sequence[Any]]
    masks: list[int]  # per tile: its open events of TILE_FLAGS kinds, as bits
    about_host: bool  # an open event about the host, not one GPU (agent_silent)

    @property
    def flagged(self) -> bool:
        """Silent, or an open event about the host or a flag on one of its tiles."""
        return self.silent or self.about_host or any(self.masks)


# A tile row: the GPU's index, total and used bytes (None: unknown), whether it is
# lost; the owner of its largest process (None also when nobody holds it), that
# process's bytes, and how many processes and distinct users hold memory on it.
TILE_COLUMNS = ("gpu_index", "total_bytes", "used_bytes", "lost", "user", "largest_bytes",
                "processes", "users")  # fmt: skip


class Fleet(NamedTuple):
    """Every host (by name) with its GPUs, and the totals the page's header shows."""

    hosts: list[FleetHost]
    gpus: int
    fullness: dict[str, int]  # GPUs per bucket, as in /api/v1/fleet
    held_bytes: dict[str, int]  # open orphaned / idle events' held memory
    flagged: dict[str, int]  # GPUs per flag
    silent_hosts: int


def fleet_tiles(*, session: Session, settings: ServerSettings, now: float) -> Fleet:
    """Every GPU with its holders and open flags: two queries whatever the fleet size."""
    return group_fleet(read_fleet(session=session), settings=settings, now=now)


class FleetRows(NamedTuple):
    """The fleet page's two reads, as rows (see :func:`read_fleet`)."""

    # hostname, last_received_at, then TILE_COLUMNS, then the flag mask: one per GPU
    # (one with a NULL index for a host without GPUs), by hostname and GPU index.
    tiles: Sequence[Sequence[Any]]
    # Open events: hostname (NULL for those about a GPU), kind, sum of held bytes.
    events: Sequence[Sequence[Any]]


def read_fleet(*, session: Session) -> FleetRows:
    """What the fleet page shows, reduced in SQL to one row per GPU.

    Measured at 1,000 hosts x 8 GPUs x 50 processes (bench/dashboard.py), reading the
    50,000 open lifetimes is most of the page's time, so everything a tile needs is
    aggregated where they are read: the GPU's largest holder, how many processes and
    users, and its open events as a bit mask of :data:`TILE_FLAGS` (reading the events
    row by row and grouping them in Python cost more than doing it in SQL). Rows come
    through Core (the ORM's row handling cost a third more), and open lifetimes and
    events are found through their ``(host_id, ended_at)`` index, so the closed ones
    that retention keeps around are never read.
    """
    connection = session.connection()
    holders = holders_by_gpu(session.get_bind().dialect.name)
    flags = _tile_flags()
    tiles = connection.execute(
        select(
            Host.hostname,
            Host.last_received_at,
            Gpu.gpu_index,
            Gpu.memory_total_bytes,
            Gpu.memory_used_bytes,
            Gpu.lost,
            holders.c.user,
            holders.c.largest_bytes,
            holders.c.processes,
            holders.c.users,
            func.coalesce(flags.c.mask, 0),
        )
        .select_from(Host)
        .outerjoin(Gpu, Gpu.host_id == Host.id)
        .outerjoin(holders, holders.c.gpu_id == Gpu.id)
        .outerjoin(flags, (flags.c.host_id == Gpu.host_id) & (flags.c.gpu_index == Gpu.gpu_index))
        .order_by(Host.hostname, Gpu.gpu_index)
    ).all()
    # Held memory by kind, and which hosts have an open event about the host itself
    # (no GPU index: agent_silent); the events of a GPU came with its tile as a mask.
    events = connection.execute(
        select(Host.hostname, Event.kind, func.sum(Event.held_bytes))
        .select_from(Event)
        .outerjoin(Host, (Host.id == Event.host_id) & Event.gpu_index.is_(None))
        .where(Event.host_id.in_(select(Host.id)), Event.ended_at.is_(None))
        .group_by(Host.hostname, Event.kind)
    ).all()
    return FleetRows(tiles, events)


def group_fleet(rows: FleetRows, *, settings: ServerSettings, now: float) -> Fleet:
    """The rows of :func:`read_fleet` grouped by host, with the page's totals: one
    pass, no object per GPU (each tile stays a tuple)."""
    held_bytes = {"orphaned": 0, "idle": 0}
    about_host: set[str] = set()
    for hostname, kind, event_bytes in rows.events:
        if hostname is not None:
            about_host.add(hostname)
        if kind in held_bytes:
            held_bytes[kind] += int(event_bytes or 0)
    reporting_since = now - silence_threshold_seconds(settings)
    counts = [0] * (len(FULLNESS_BUCKETS) + 2)  # the buckets, full, unknown
    unknown = len(counts) - 1
    masks_seen: dict[int, int] = {}
    hosts: list[FleetHost] = []
    tiles: list[Sequence[Any]] = []
    masks: list[int] = []
    last = None
    silent = False
    for row in rows.tiles:
        hostname, received, index, total, used, lost = row[:6]
        if hostname != last:
            last, silent = hostname, received is None or received < reporting_since
            tiles, masks = [], []
            hosts.append(FleetHost(hostname, silent, tiles, masks, hostname in about_host))
        if index is None:  # a host whose agent never reported a GPU
            continue
        if silent or lost or used is None or not total:
            counts[unknown] += 1
        else:
            percent = used * 100 // total
            counts[_BUCKET_BY_PERCENT[percent if percent < 100 else 100]] += 1
        tiles.append(row[2:10])
        mask = row[10]
        masks.append(mask)
        if mask:
            masks_seen[mask] = masks_seen.get(mask, 0) + 1
    flagged = {
        kind: sum(n for mask, n in masks_seen.items() if mask & 1 << bit)
        for bit, kind in enumerate(TILE_FLAGS)
    }
    names = [name for name, _ in FULLNESS_BUCKETS] + [FULL_BUCKET, UNKNOWN_BUCKET]
    return Fleet(
        hosts=hosts,
        gpus=sum(counts),
        fullness=dict(zip(names, counts, strict=True)),
        held_bytes=held_bytes,
        flagged=flagged,
        silent_hosts=sum(1 for host in hosts if host.silent),
    )


# Fullness bucket (an index into FULLNESS_BUCKETS, then full) by whole percent used:
# ``used / total < 0.25`` exactly when ``used * 100 // total < 25`` in integers, so a
# tile's bucket and its colour (tenths) come from the same integer division.
_BUCKET_BY_PERCENT = [
    bisect_right([round(bound * 100) for _, bound in FULLNESS_BUCKETS], percent)
    for percent in range(101)
]


def _tile_flags() -> Subquery:
    """Per GPU (host and index) with an open event: which of :data:`TILE_FLAGS`, as a
    bit mask (0: none of them), so the tile query stays one row per GPU."""
    bit = case(*((Event.kind == kind, 1 << i) for i, kind in enumerate(TILE_FLAGS)), else_=0)
    return (
        select(Event.host_id, Event.gpu_index, func.sum(bit.distinct()).label("mask"))
        .where(
            Event.host_id.in_(select(Host.id)),
            Event.ended_at.is_(None),
            Event.gpu_index.is_not(None),
        )
        .group_by(Event.host_id, Event.gpu_index)
        .subquery()
    )


def holders_by_gpu(dialect: str) -> Subquery:
    """Per GPU with open lifetimes: the owner of the largest and its bytes, and how many
    processes and distinct users hold memory there; one row per GPU, picked in SQL.
    SQLite takes a bare column of a ``max()`` aggregate from the row holding the
    maximum (a window function there cost five times as much); Postgres ranks."""
    life = ProcessLifetime
    open_ = (life.host_id.in_(select(Host.id)), life.ended_at.is_(None))
    if dialect == "sqlite":
        return (
            select(
                life.gpu_id,
                life.user,
                func.max(life.current_bytes).label("largest_bytes"),
                func.count().label("processes"),
                func.count(life.user.distinct()).label("users"),
            )
            .where(*open_)
            .group_by(life.gpu_id)
            .subquery()
        )
    counted = (
        select(
            life.gpu_id,
            func.count().label("processes"),
            func.count(life.user.distinct()).label("users"),
        )
        .where(*open_)
        .group_by(life.gpu_id)
        .subquery()
    )
    ranked = (
        select(
            life.gpu_id,
            life.user,
            life.current_bytes.label("largest_bytes"),
            func.row_number()
            .over(
                partition_by=life.gpu_id,
                order_by=(life.current_bytes.desc().nulls_last(), life.id),
            )
            .label("rank"),
        )
        .where(*open_)
        .subquery()
    )
    largest = select(ranked).where(ranked.c.rank == 1).subquery()
    return (
        select(
            largest.c.gpu_id,
            largest.c.user,
            largest.c.largest_bytes,
            counted.c.processes,
            counted.c.users,
        )
        .join(counted, counted.c.gpu_id == largest.c.gpu_id)
        .subquery()
    )


def firing_alerts(*, session: Session) -> int:
    """How many alerts fire now (the count in every page's navigation)."""
    return session.scalar(select(func.count(AlertRow.id)).where(AlertRow.state == "firing")) or 0


class GpuRef(NamedTuple):
    """What a chart needs of a GPU row besides its history."""

    id: int
    gpu_index: int
    uuid: str
    total_bytes: int | None
    used_bytes: int | None
    last_seen_at: float


def host_gpus(*, session: Session, hostname: str) -> list[GpuRef]:
    """The GPUs of ``hostname`` by index (empty for an unknown host)."""
    rows = session.execute(
        select(
            Gpu.id,
            Gpu.gpu_index,
            Gpu.uuid,
            Gpu.memory_total_bytes,
            Gpu.memory_used_bytes,
            Gpu.last_seen_at,
        )
        .join(Host, Host.id == Gpu.host_id)
        .where(Host.hostname == hostname)
        .order_by(Gpu.gpu_index, Gpu.uuid)
    ).all()
    return [GpuRef(*row) for row in rows]


class Layer(NamedTuple):
    """One band of a stacked chart: a process (or the sum of the smaller ones)."""

    lifetime_id: int | None  # None for "other"
    pid: int | None
    user: str | None
    command: str | None
    values: list[int]  # bytes per column; 0 where it held nothing
    peak_bytes: int
    processes: int  # 1, or how many "other" sums


class History(NamedTuple):
    """A GPU's memory over ``[since, since + step * columns)``, per column of ``step``
    seconds: each process's highest memory in the column, and the GPU's used memory
    (None where no sample fell in the column)."""

    since: float
    step: float
    layers: list[Layer]  # largest first (drawn at the bottom)
    used: list[int | None]
    total_bytes: int | None

    @property
    def until(self) -> float:
        return self.since + self.step * len(self.used)


def chart_step(*, seconds: float, interval: float, columns: int) -> int:
    """Column width in whole seconds: a whole number of sample intervals (rounded up to
    a second), so that at most ``columns`` columns cover ``seconds``."""
    intervals = max(1, math.ceil(seconds / interval / columns))
    return max(1, math.ceil(intervals * interval))


def histories(
    *,
    session: Session,
    gpus: Sequence[GpuRef],
    until: float,
    seconds: float,
    interval: float,
    columns: int,
) -> dict[int, History]:
    """Memory history of each of ``gpus`` over the ``seconds`` before ``until``, in at
    most ``columns`` columns: one query for the lifetimes, one for their samples (max
    per column, grouped in SQL), one for the GPUs' own samples. The newest column also
    holds what open processes hold now, which no closed sample has yet."""
    if not gpus:
        return {}
    step = chart_step(seconds=seconds, interval=interval, columns=columns)
    count = math.ceil(seconds / step) + 1
    since = math.floor((until - seconds) / step) * step  # whole seconds, like step
    end = since + count * step
    gpu_ids = [gpu.id for gpu in gpus]
    lifetimes = session.execute(
        select(
            ProcessLifetime.id,
            ProcessLifetime.gpu_id,
            ProcessLifetime.pid,
            ProcessLifetime.user,
            ProcessLifetime.command,
            ProcessLifetime.last_seen_at,
            ProcessLifetime.ended_at,
            ProcessLifetime.current_bytes,
        )
        .where(
            ProcessLifetime.gpu_id.in_(gpu_ids),
            ProcessLifetime.first_seen_at < end,
            func.coalesce(ProcessLifetime.ended_at, ProcessLifetime.last_seen_at) >= since - step,
        )
        .order_by(ProcessLifetime.first_seen_at.desc())
        .limit(MAX_LIFETIMES)
    ).all()
    values: dict[int, list[int]] = {row.id: [0] * count for row in lifetimes}
    if values:
        column = _column(ProcessSample.t, since, step)
        for lifetime_id, col, peak in session.execute(
            select(
                ProcessSample.lifetime_id,
                column,
                func.max(func.coalesce(ProcessSample.peak_bytes, ProcessSample.used_bytes)),
            )
            .where(
                ProcessSample.lifetime_id.in_(list(values)),
                ProcessSample.t >= since,
                ProcessSample.t < end,
            )
            .group_by(ProcessSample.lifetime_id, column)
        ):
            if col is not None and 0 <= col < count and peak is not None:
                values[lifetime_id][col] = int(peak)
    used: dict[int, list[int | None]] = {gpu_id: [None] * count for gpu_id in gpu_ids}
    gpu_column = _column(GpuSample.t, since, step)
    for gpu_id, gpu_col, gpu_peak in session.execute(
        select(GpuSample.gpu_id, gpu_column, func.max(GpuSample.used_bytes))
        .where(GpuSample.gpu_id.in_(gpu_ids), GpuSample.t >= since, GpuSample.t < end)
        .group_by(GpuSample.gpu_id, gpu_column)
    ):
        if gpu_col is not None and 0 <= gpu_col < count and gpu_peak is not None:
            used[gpu_id][gpu_col] = int(gpu_peak)
    for gpu in gpus:  # the live reading, not yet in a closed bucket
        live = int((gpu.last_seen_at - since) // step)
        if gpu.used_bytes is not None and 0 <= live < count:
            used[gpu.id][live] = max(used[gpu.id][live] or 0, gpu.used_bytes)
    per_gpu: dict[int, list[Layer]] = {gpu_id: [] for gpu_id in gpu_ids}
    for row in lifetimes:
        series = values[row.id]
        if row.ended_at is None and row.current_bytes is not None:
            live = int((row.last_seen_at - since) // step)
            if 0 <= live < count:
                series[live] = max(series[live], row.current_bytes)
        peak = max(series)
        if peak > 0:
            per_gpu[row.gpu_id].append(
                Layer(row.id, row.pid, row.user, row.command, series, peak, 1)
            )
    return {
        gpu.id: History(
            since, step, _top_layers(per_gpu[gpu.id], count), used[gpu.id], gpu.total_bytes
        )
        for gpu in gpus
    }


def _column(t: InstrumentedAttribute[float], since: int, step: int) -> ColumnElement[int]:
    """``(t - since) // step`` in SQL, in integers on both databases, so both cut the
    same columns (``t`` are bucket starts: whole seconds for whole-second intervals)."""
    return (cast(t, BigInteger) - literal(since, Integer)) // literal(step, Integer)


def _top_layers(layers: list[Layer], count: int) -> list[Layer]:
    layers.sort(key=lambda layer: -layer.peak_bytes)
    if len(layers) <= MAX_LAYERS:
        return layers
    kept, rest = layers[: MAX_LAYERS - 1], layers[MAX_LAYERS - 1 :]
    summed = [sum(column) for column in zip(*(layer.values for layer in rest), strict=True)]
    other = Layer(None, None, None, None, summed, max(summed, default=0), len(rest))
    return [*kept, other]
