"""The dashboard's own reads for the host and GPU pages: the memory history behind the
charts, already cut into the chart's columns in SQL, so a month of one-minute samples
arrives as a few hundred rows per process; and the firing alerts every page counts.

Everything else the pages show comes from the domain services (hosts, events, alerts);
the fleet page's tiles are read in :mod:`gpuwatch.server.web.tiles`.

Sizes are bytes, times Unix epoch seconds (the agents' clocks, as stored), as in the
rest of the server.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

from sqlalchemy import BigInteger, ColumnElement, Integer, case, cast, func, literal, select
from sqlalchemy.orm import InstrumentedAttribute, Session

from gpuwatch.server.alerts.models import AlertRow
from gpuwatch.server.hosts.models import Gpu, GpuSample, Host
from gpuwatch.server.processes.models import ProcessLifetime, ProcessSample

# Processes drawn one by one in a chart; the rest are summed into one "other" layer.
MAX_LAYERS = 10
# Lifetimes read for one chart at most: a month of short jobs on one GPU. Each chart
# has its own share (the host page draws one per GPU): one GPU's short jobs once took a
# page-wide limit and left another GPU's chart without the process that filled it.
MAX_LIFETIMES = 2000
# Lifetimes read for one page, shared by its charts (each keeps at least
# MIN_CHART_LIFETIMES): a 64-GPU host's page reads 12,800, not 128,000.
MAX_PAGE_LIFETIMES = 8000
MIN_CHART_LIFETIMES = 200


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
    per_chart = min(MAX_LIFETIMES, max(MIN_CHART_LIFETIMES, MAX_PAGE_LIFETIMES // len(gpu_ids)))
    # Each GPU's own: those still open (what fills it now), then the largest, then the
    # newest.
    rank = func.row_number().over(
        partition_by=ProcessLifetime.gpu_id,
        order_by=(
            case((ProcessLifetime.ended_at.is_(None), 0), else_=1),
            ProcessLifetime.peak_bytes.desc().nulls_last(),
            ProcessLifetime.first_seen_at.desc(),
        ),
    )
    ranked = (
        select(
            ProcessLifetime.id,
            ProcessLifetime.gpu_id,
            ProcessLifetime.pid,
            ProcessLifetime.user,
            ProcessLifetime.command,
            ProcessLifetime.last_seen_at,
            ProcessLifetime.ended_at,
            ProcessLifetime.current_bytes,
            rank.label("rank"),
        )
        .where(
            ProcessLifetime.gpu_id.in_(gpu_ids),
            ProcessLifetime.first_seen_at < end,
            func.coalesce(ProcessLifetime.ended_at, ProcessLifetime.last_seen_at) >= since - step,
        )
        .subquery()
    )
    lifetimes = session.execute(
        select(ranked).where(ranked.c.rank <= per_chart).order_by(ranked.c.gpu_id, ranked.c.rank)
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
