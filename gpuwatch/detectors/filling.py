"""Filling up: a GPU whose used memory keeps rising and will reach its total soon.

A leak is about one holder; a GPU fills up from the sum of all of them (several jobs
each growing a little, a new process arriving while others grow). The evidence is the
same as for a leak (:mod:`gpuwatch.detectors.growth`), on the GPU's own bucket samples,
so memory that breathes, a GPU that is full but flat, and one job loading a second
model are not filling up. On top of that, the growth must still be going on (the floor
rose over the newest third of the window at the minimum slope or more: a warm-up that
has levelled off is not filling up however steep the window's line is), a verdict
opens only while the newest bucket shows the memory rising, and the line must reach the GPU's total within a horizon (at the current rate, see
:func:`~gpuwatch.detectors.growth.current_rate`). The processes that grew
are named, largest contribution first.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from gpuwatch.detectors._format import format_bytes, format_seconds
from gpuwatch.detectors.growth import (
    CLEARANCE_MIN_BYTES,
    Growth,
    climbing_at_poll,
    current_rate,
    floor_slope,
    growing_now,
    keeping_pace,
    new_height,
    passing_growth,
    points,
    recent_slope,
    step_held,
    through_dips,
    without_dips,
)
from gpuwatch.detectors.types import Finding, Sample


def detect_filling(
    samples: Sequence[Sample],
    *,
    now: float,
    total_bytes: int | None,
    free_bytes: int | None,
    horizon_seconds: float,
    min_slope_bytes_per_second: float,
    min_duration_seconds: float,
    processes: Mapping[int, Sequence[Sample]],
    already_open: bool = False,
    held_before_bytes: int | None = None,
    now_bytes: int | None = None,
) -> Finding | None:
    """Return a ``filling_up`` finding if the GPU's used memory grows and, at that rate,
    the GPU is full within ``horizon_seconds``.

    ``samples`` are the GPU's bucket samples of used memory (``used_bytes`` the lowest of
    the bucket, ``peak_bytes`` the highest; bytes, epoch s), judged as by
    :func:`~gpuwatch.detectors.detect_leak` with the same ``min_slope_bytes_per_second``
    and ``min_duration_seconds``. ``free_bytes`` (the GPU's, now) over the current rate
    is the time to full; when it is unknown, ``total_bytes`` minus the newest floor is used. A
    GPU whose total and free are both unknown cannot be judged.

    A verdict *opens* (``already_open`` False) only while the newest bucket shows the
    memory rising (:func:`growing_now`) and, given ``held_before_bytes`` (the GPU's
    highest floor in history older than ``samples``), above every level it held before
    (:func:`new_height`: a long cycle's rise, which stopped short of full last time, is
    not filling up); an open one continues while the rest holds. Given ``now_bytes``, the
    GPU's used memory at the poll at hand (``now``), it must also still be climbing at
    that poll (:func:`climbing_at_poll`): the closed buckets lag a load that has stopped.

    ``processes`` maps each PID on the GPU to its own bucket samples; the evidence's
    ``culprits`` lists those whose floor rose across the GPU's window, as
    ``{"pid", "slope_bytes_per_second", "growth_bytes", "growth_share"}`` ranked by
    ``growth_bytes`` (largest first). ``growth_bytes`` is the process's lowest memory in
    the GPU's current span minus its lowest in the reference span (0 where it was not
    there yet); ``growth_share`` is its part of the culprits' total growth (0..1);
    the slope is the Theil–Sen slope of its floors over the GPU's window.

    Evidence: the growth numbers (``slope_bytes_per_second``, ``confidence``, ...),
    ``recent_slope_bytes_per_second`` (how fast the floor rose over the newest third of
    the window, which must also be at least the minimum slope: growth that has stopped
    is not filling up), ``full_rate_bytes_per_second`` (the window's slope, or the
    recent one where faster, up to twice the slope: :func:`current_rate`),
    ``time_to_full_seconds`` (room over that rate),
    ``horizon_seconds``, ``full_basis`` (``free`` or ``total``), ``gpu_free_bytes``,
    ``gpu_total_bytes`` and ``culprits``.
    """
    given = {s.t for s in samples if s.used_bytes is not None and s.t <= now}
    newest = max(given, default=None)
    if already_open:
        # An open verdict looks through a dip the memory came back from (or, newest, may).
        samples, min_duration_seconds = through_dips(
            samples, now=now, min_duration_seconds=min_duration_seconds
        )
    else:
        # So does one that opens, through dips already come back from: a neighbour
        # restarted under a new PID every W or less (a crash loop, a cron restart) left
        # a low floor in every window, and a GPU filling beside it never opened. Not
        # during one: a neighbour reloading is a steep rise that is no fill.
        samples = without_dips(samples, now=now)
        if samples and samples[-1].t != newest:
            return None
    growth = passing_growth(
        samples,
        now=now,
        min_duration_seconds=min_duration_seconds,
        min_slope_bytes_per_second=min_slope_bytes_per_second,
        already_open=already_open,
    )
    if growth is None:
        return None
    opening = None if already_open else _opening(samples, growth, now, now_bytes, held_before_bytes)
    if not already_open and opening is None:
        return None
    # A step that has held is growth going on, as an open verdict's is: its rate is
    # judged over the newest half (see recent_slope; over a third, a chunk W/3 after the
    # last lay between neither stretch's start, and it never opened).
    recent = recent_slope(
        samples, now=now, since=growth.window_start, already_open=already_open or opening == "step"
    )
    if recent < min_slope_bytes_per_second:
        return None  # it grew, but it has stopped: no longer filling up
    if free_bytes is not None:
        basis, room = "free", free_bytes
        if already_open and total_bytes is not None:
            # An open verdict's room is the level's, not a dip's at the window's end or
            # at the poll at hand (a neighbour restarting freed its 25 GiB for a minute,
            # which put the time to full past the horizon and closed the verdict). A
            # drop that lasts reaches the window's buckets and closes it there.
            room = min(room, max(total_bytes - growth.newest_bytes, 0))
    elif total_bytes is not None:
        basis, room = "total", max(total_bytes - growth.newest_bytes, 0)
    else:
        return None
    # At the current rate: the window's slope is a blend where growth began inside it.
    rate = current_rate(growth, recent)
    left_out = given - {s.t for s in samples}
    if max(left_out, default=0.0) >= growth.window_end - growth.window_seconds / 3:
        # A dip left out of the newest third leaves a hole that its edges' middles move
        # across, and the recent rate then reads the restart's own reload (329 MiB/min
        # for 256, which opened a fill 25 minutes early): the window's line instead.
        rate = growth.slope
    time_to_full = room / rate
    if time_to_full > horizon_seconds * (OPEN_HORIZON_SLACK if already_open else 1.0):
        return None
    culprits = _culprits(growth, samples, processes, now=now)
    summary = (
        f"GPU memory grew {growth.slope * 60 / 2**20:.1f} MiB/min for "
        f"{format_seconds(growth.window_seconds)} ({recent * 60 / 2**20:.1f} MiB/min "
        f"lately); it is full in "
        f"{'at most ' if basis == 'total' else ''}{format_seconds(time_to_full)} at this rate"
    )
    if culprits:
        pid, _, gained = culprits[0]
        summary += f" (most from process {pid}, +{format_bytes(gained)})"
    return Finding(
        kind="filling_up",
        reason="filling_up",
        summary=summary,
        held_bytes=None if total_bytes is None else total_bytes - room,
        evidence={
            **growth.evidence(),
            "recent_slope_bytes_per_second": recent,
            "full_rate_bytes_per_second": rate,
            "time_to_full_seconds": time_to_full,
            "horizon_seconds": horizon_seconds,
            "full_basis": basis,
            "gpu_free_bytes": free_bytes,
            "gpu_total_bytes": total_bytes,
            "culprits": _ranked(culprits),
        },
    )


# An open verdict continues while the GPU is full within this many horizons. The
# window's slope moves a little at every bucket (a chunk enters, an old one leaves), so a
# fill whose time to full sat near the horizon (2 GiB every 4 min onto an 80 GiB GPU:
# 1.9 to 2.0 h) opened, closed and opened again as a new event every few minutes.
OPEN_HORIZON_SLACK = 1.25


# A process is named a culprit only for growth above this (and above the spread of its
# own floors in the reference span): a flat process's lowest poll differs between two
# spans by its noise alone, which named steady jobs beside the real grower in one
# verdict of ten. The same bar as the growth evidence's clearance: below it is noise
# or NVML's rounding.
CULPRIT_MIN_BYTES = CLEARANCE_MIN_BYTES


def _opening(
    samples: Sequence[Sample],
    growth: Growth,
    now: float,
    now_bytes: int | None,
    held_before_bytes: int | None,
) -> str | None:
    """Whether a verdict may open: the memory seen rising over the newest stretches
    and still climbing at the poll at hand (the closed buckets of a warm-up rise for a
    minute or two after it levelled off), or a step that has held for a bucket and
    keeps pace with the window's line (a transient allocation is a step too); and
    above every level it held before the window (a long cycle's rise). ``"rising"`` or
    ``"step"``, by which way it opens; None where it may not."""
    if not new_height(growth, held_before_bytes):
        return None
    slope = growth.slope
    if growing_now(samples, now=now, slope=slope) and climbing_at_poll(
        samples, now=now, now_bytes=now_bytes, slope=slope
    ):
        return "rising"
    # A chunk: held for a bucket, climbing from the bucket it came in, in pace.
    stepped = (
        step_held(samples, now=now, slope=slope, now_bytes=now_bytes)
        and climbing_at_poll(samples, now=now, now_bytes=now_bytes, slope=slope, buckets_back=2)
        and keeping_pace(
            samples,
            now=now,
            now_bytes=now_bytes,
            slope=slope,
            window_seconds=growth.window_seconds,
        )
    )
    return "step" if stepped else None


def _culprits(
    growth: Growth,
    samples: Sequence[Sample],
    processes: Mapping[int, Sequence[Sample]],
    *,
    now: float,
) -> list[tuple[int, float, int]]:
    """``(pid, slope, growth)`` of the processes whose floor rose from the GPU's reference
    span to its current one, largest growth first.

    A process that was not there in the reference span held nothing then, but what
    processes gone since held is set against the newcomers' holdings, largest first: a
    server restarted under a new PID is not a 20 GiB grower beside the process that
    really leaks. Nor is one whose predecessor is not among ``processes`` at all (the
    caller passes the live ones): the newcomers together are credited with no more than
    the GPU's net growth leaves once the processes there all along (their rises and
    falls) and those gone since are accounted for. A steady 30 GiB job restarted under a
    new PID (within one poll) beside a grower was otherwise named the grower of all
    30 GiB, for as long as the verdict stayed open."""
    current_from = growth.window_end - growth.current_seconds
    gpu_reference, gpu_spread = _reference_level(growth, samples, now=now)
    grown: list[tuple[int, float, int]] = []
    newcomers: list[tuple[int, float, int]] = []
    departed = 0
    incumbents_changed = 0
    for pid, samples in processes.items():
        pts = [p for p in points(samples, now=now) if p[0] >= growth.window_start]
        current = [f for t, f, _ in pts if t >= current_from]
        reference = [f for t, f, _ in pts if t <= growth.reference_end]
        if not current or pts[-1][0] < growth.window_end:
            # Gone by now: it cannot be making the GPU fuller, and what it held in the
            # reference span is free again.
            departed += min(reference) if reference else 0
            continue
        if not reference:
            newcomers.append((pid, floor_slope(pts), min(current)))
            continue
        gained = min(current) - min(reference)
        incumbents_changed += gained
        # Risen by more than its floors moved in the reference span: a steady job's
        # lowest poll wanders by its noise, a grower's floor rises past all of it.
        if gained > max(CULPRIT_MIN_BYTES, max(reference) - min(reference)):
            grown.append((pid, floor_slope(pts), gained))
    # What the newcomers can hold in all: the GPU's rise less the incumbents' change,
    # plus what the known departed freed (their holding is in the GPU's reference floor).
    # What the newcomers can hold in all: the GPU's rise less the incumbents' change,
    # plus what the known departed freed (their holding is in the GPU's reference floor).
    arrived = growth.current_floor_bytes - gpu_reference - incumbents_changed + departed
    for pid, slope, held in sorted(newcomers, key=lambda c: (-c[2], c[0])):
        counted = max(0, min(held, arrived))
        arrived -= counted
        replaced = min(counted, departed)
        departed -= replaced
        # Beyond what the GPU's level moves within a bucket: the budget sets GPU levels
        # against the processes' floors, which differ by that much.
        if counted - replaced > max(CULPRIT_MIN_BYTES, gpu_spread):
            grown.append((pid, slope, counted - replaced))
    grown.sort(key=lambda c: (-c[2], c[0]))
    return grown


def _reference_level(growth: Growth, samples: Sequence[Sample], *, now: float) -> tuple[int, int]:
    """The GPU's level in its reference span, and its buckets' usual spread (a bucket's
    peak over its floor, the median over the window). The level is the lowest of the
    span's floors, each raised to its peak less the usual spread where it spread wider:
    a bucket that spread far wider than the rest held a dip. A restart's moment (the old
    PID gone, the new one not yet up) sank its floor by all that the new PID then held,
    and in a reference span of one bucket that named the restarted job the grower of
    it."""
    pts = [p for p in points(samples, now=now) if p[0] >= growth.window_start]
    usual = _median_int([peak - floor for _, floor, peak in pts])
    levels = [max(f, p - usual) for t, f, p in pts if t <= growth.reference_end]
    return min(levels, default=growth.reference_floor_bytes), usual


def _median_int(values: list[int]) -> int:
    values = sorted(values)
    return values[len(values) // 2] if values else 0


def _ranked(grown: list[tuple[int, float, int]]) -> list[dict[str, object]]:
    total = sum(g for _, _, g in grown)
    return [
        {
            "pid": pid,
            "slope_bytes_per_second": slope,
            "growth_bytes": gained,
            "growth_share": gained / total,
        }
        for pid, slope, gained in grown
    ]
