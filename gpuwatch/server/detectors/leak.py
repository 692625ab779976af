"""Leaks: a holder whose memory floor keeps rising, and when the GPU fills up if it goes on.

Raw memory samples are a poor leak signal: a training loop allocates activations on
every step and frees them again, so its memory saw-tooths, and the caching allocator
adds steps. What grows in a leak is the *floor*, the memory still held at the quietest
moment. So the trace is cut into :data:`BUCKETS` equal spans of time, each span keeps
its lowest sample, and the slope is the Theil–Sen estimate (median of pairwise slopes)
over those floors: robust to an outlier span and blind to oscillation that does not
grow. A single step up (a second model loaded) is not growth either, so the rule also
asks that the floor rise from each quarter of the trace to the next.

Cost: sorting is O(n log n) on at most :data:`MAX_SAMPLES` newest samples; the slope
is over :data:`BUCKETS` points, a constant.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

from gpuwatch.server.detectors._format import format_bytes, format_seconds
from gpuwatch.server.detectors.types import Finding, Sample

# Newest samples considered; at a 5 s poll this is 14 h, far longer than any window
# the server asks about, and it bounds the work on a hostile or runaway history.
MAX_SAMPLES = 10_000
# Spans per trace. Divisible by QUARTERS; 16 spans of a 30 min window are ~2 min each,
# longer than a typical training step, so each span's floor sees a quiet moment.
BUCKETS = 16
QUARTERS = 4
_MIB = 2**20


@dataclass(frozen=True)
class _Floor:
    """The lowest sample of one span: when it was seen (s) and how much was held (bytes)."""

    t: float
    used_bytes: int


def detect_leak(
    samples: Sequence[Sample],
    *,
    now: float,
    gpu_total_bytes: int | None,
    gpu_free_bytes: int | None,
    min_slope_bytes_per_second: float,
    min_duration_seconds: float,
) -> Finding | None:
    """Return a ``runaway``/``leak`` finding if memory grew steadily over the trace.

    Flags when the trace of known samples (``used_bytes`` not ``None``, ``t <= now``)
    spans at least ``min_duration_seconds``, every quarter of it has samples, the floor
    of each quarter is above the one before, and the robust slope of the span floors
    is at least ``min_slope_bytes_per_second``.

    Evidence: ``slope_bytes_per_second``, ``slope_mib_per_minute``, ``r_squared`` of the
    floors about that line, ``monotonic_fraction`` (share of span-to-span steps that do
    not go down), ``window_start``/``window_end`` (epoch s), ``window_seconds``,
    ``samples``, and ``time_to_exhaust_seconds``: ``gpu_free_bytes / slope``, the time
    until the GPU is full at this rate. When free memory is unknown but the total is
    known, ``(gpu_total_bytes - held) / slope`` is given instead as an upper bound
    (other holders use memory too) and ``exhaust_basis`` says which one it is.
    """
    known = sorted(
        ((s.t, s.used_bytes) for s in samples if s.used_bytes is not None and s.t <= now),
    )[-MAX_SAMPLES:]
    duration = known[-1][0] - known[0][0] if known else 0.0
    if len(known) < BUCKETS or duration <= 0 or duration < min_duration_seconds:
        return None
    floors = _span_floors(known)
    quarters = _quarter_floors(floors)
    if quarters is None or any(later <= earlier for earlier, later in pairwise(quarters)):
        return None
    points = [f for f in floors if f is not None]
    slope = _theil_sen_slope(points)
    if slope <= 0 or slope < min_slope_bytes_per_second:
        return None
    return _finding(known, points, slope, gpu_total_bytes, gpu_free_bytes)


def _span_floors(known: list[tuple[float, int]]) -> list[_Floor | None]:
    """The lowest sample of each of BUCKETS equal time spans (None for a span without any)."""
    start, end = known[0][0], known[-1][0]
    width = (end - start) / BUCKETS
    floors: list[_Floor | None] = [None] * BUCKETS
    for t, used in known:
        i = min(int((t - start) / width), BUCKETS - 1)
        current = floors[i]
        # Strictly lower only: on a tie the earliest sample stays, so input order is moot.
        if current is None or used < current.used_bytes:
            floors[i] = _Floor(t, used)
    return floors


def _quarter_floors(floors: list[_Floor | None]) -> list[int] | None:
    """Lowest floor in each quarter of the trace, or None if a quarter has no samples."""
    per_quarter = BUCKETS // QUARTERS
    result = []
    for q in range(QUARTERS):
        quarter = floors[q * per_quarter : (q + 1) * per_quarter]
        values = [f.used_bytes for f in quarter if f is not None]
        if not values:
            return None
        result.append(min(values))
    return result


def _theil_sen_slope(points: list[_Floor]) -> float:
    """Median of the pairwise slopes (bytes/s); pairs at the same instant are skipped."""
    slopes = [
        (b.used_bytes - a.used_bytes) / (b.t - a.t)
        for i, a in enumerate(points)
        for b in points[i + 1 :]
        if b.t > a.t
    ]
    return statistics.median(slopes) if slopes else 0.0


def _r_squared(points: list[_Floor], slope: float) -> float:
    """Share of the floors' variance the Theil–Sen line explains (1.0 for a perfect line).

    Values are taken relative to the first floor so that a constant offset in bytes
    changes nothing, not even rounding.
    """
    base_t, base_v = points[0].t, points[0].used_bytes
    xs = [p.t - base_t for p in points]
    ys = [float(p.used_bytes - base_v) for p in points]
    intercept = statistics.median(y - slope * x for x, y in zip(xs, ys, strict=True))
    mean_y = statistics.fmean(ys)
    total = sum((y - mean_y) ** 2 for y in ys)
    residual = sum((y - (intercept + slope * x)) ** 2 for x, y in zip(xs, ys, strict=True))
    return 1.0 - residual / total if total > 0 else 0.0


def _finding(
    known: list[tuple[float, int]],
    floors: list[_Floor],
    slope: float,
    gpu_total_bytes: int | None,
    gpu_free_bytes: int | None,
) -> Finding:
    held = known[-1][1]
    window_start, window_end = known[0][0], known[-1][0]
    steps = list(pairwise(floors))
    monotonic = sum(b.used_bytes >= a.used_bytes for a, b in steps) / len(steps)
    if gpu_free_bytes is not None:
        basis: str | None = "free"
        exhaust: float | None = gpu_free_bytes / slope
    elif gpu_total_bytes is not None:
        basis, exhaust = "total", max(gpu_total_bytes - held, 0) / slope
    else:
        basis, exhaust = None, None
    per_minute = slope * 60 / _MIB
    summary = (
        f"memory grew {per_minute:.1f} MiB/min for {format_seconds(window_end - window_start)}"
    )
    summary += f" to {format_bytes(held)}"
    if exhaust is not None:
        bound = "" if basis == "free" else " at most"
        summary += f"; the GPU is full in{bound} {format_seconds(exhaust)} at this rate"
    return Finding(
        kind="runaway",
        reason="leak",
        summary=summary,
        held_bytes=held,
        evidence={
            "slope_bytes_per_second": slope,
            "slope_mib_per_minute": per_minute,
            "r_squared": _r_squared(floors, slope),
            "monotonic_fraction": monotonic,
            "window_start": window_start,
            "window_end": window_end,
            "window_seconds": window_end - window_start,
            "samples": len(known),
            "time_to_exhaust_seconds": exhaust,
            "exhaust_basis": basis,
            "gpu_free_bytes": gpu_free_bytes,
            "gpu_total_bytes": gpu_total_bytes,
        },
    )
