"""Leaks: a holder whose memory keeps rising above what it held before, and when the
GPU fills up if it goes on.

Raw memory samples are a poor leak signal: a training loop allocates activations on
every step and frees them again, evaluation phases come and go, and the caching
allocator adds steps. The evidence is therefore the one in :mod:`growth`: the current
floor must stand above the peaks seen earlier in the window (which no periodic signal
shorter than the window can do), and the floors must follow a rising line that one
step alone cannot make. The window is the samples the caller passes (the server passes
``min_duration_seconds`` of buckets, plus two intervals of slack).

Guarantee, for a window of ``W`` seconds: memory that repeats with any period up to
``W`` (saw-tooth, square, sine, any phase, polled with jitter that does not
accumulate) is never a leak. Detection delay: a holder that leaks from its start is
flagged once ``W`` of it has been seen; one that starts leaking after ``W`` of steady
history, once the leak fills about 0.6 of the window; a leak under an oscillation of
amplitude ``A`` also needs ``slope * W / 2 > A``. docs/detection.md has the details and
the measured figures.
"""

from __future__ import annotations

from collections.abc import Sequence

from gpuwatch.detectors._format import format_bytes, format_seconds
from gpuwatch.detectors.growth import (
    MAX_SAMPLES,
    Growth,
    current_rate,
    growing_now,
    new_height,
    passing_growth,
    recent_slope,
    through_dips,
)
from gpuwatch.detectors.types import Finding, Sample

__all__ = ["MAX_SAMPLES", "detect_leak"]


def detect_leak(
    samples: Sequence[Sample],
    *,
    now: float,
    gpu_total_bytes: int | None,
    gpu_free_bytes: int | None,
    min_slope_bytes_per_second: float,
    min_duration_seconds: float,
    already_open: bool = False,
    held_before_bytes: int | None = None,
) -> Finding | None:
    """Return a ``runaway``/``leak`` finding if the holder's memory grew over the window.

    ``samples`` are the holder's bucket samples (or raw polls): ``used_bytes`` the
    lowest memory (bytes) of the bucket, ``peak_bytes`` the highest (``None``: the same
    as ``used_bytes``). Samples with unknown memory or after ``now`` (epoch s) are
    skipped; the newest :data:`MAX_SAMPLES` are used. The window must span at least
    ``min_duration_seconds``; that span is also the longest period of oscillation the
    verdict is proof against (``period_bound_seconds`` in the evidence).

    Flags when every piece of evidence agrees (:mod:`gpuwatch.detectors.growth`): the
    current floor clears the earlier peaks, the floors' Theil–Sen slope is at least
    ``min_slope_bytes_per_second`` with ``r_squared`` and ``monotonic_fraction`` at or
    above their minimums (both are in the evidence).

    A verdict *opens* (``already_open`` False) only while the newest bucket shows the
    memory rising (:func:`~gpuwatch.detectors.growth.growing_now`): a model streamed in
    over a few minutes, or two allocations minutes apart, pass every other check for a
    while after the memory has levelled off. An open one continues while the rest holds.

    ``held_before_bytes``, when the caller keeps history older than ``samples``: the
    highest floor the holder held in it. A verdict opens only once the memory stands
    above that (:func:`~gpuwatch.detectors.growth.new_height`): a cycle longer than the
    window climbs back to where its last cycle went, and that is no leak.

    Evidence, besides the growth numbers and ``confidence`` (0..1):
    ``time_to_exhaust_seconds``, ``gpu_free_bytes / rate``, the time until the GPU is
    full at the current rate (``exhaust_rate_bytes_per_second``: the window's slope, or
    ``recent_slope_bytes_per_second`` where faster, up to twice the slope, see
    :func:`~gpuwatch.detectors.growth.current_rate`). When free memory is unknown but
    the total is known, ``(gpu_total_bytes - held) / rate`` is given instead as an
    upper bound (other holders use memory too) and ``exhaust_basis`` says which one it
    is.
    """
    if already_open:
        # An open verdict looks through a dip the memory came back from (or, newest, may).
        samples, min_duration_seconds = through_dips(
            samples, now=now, min_duration_seconds=min_duration_seconds
        )
    growth = passing_growth(
        samples,
        now=now,
        min_duration_seconds=min_duration_seconds,
        min_slope_bytes_per_second=min_slope_bytes_per_second,
        already_open=already_open,
    )
    if growth is None:
        return None
    recent = recent_slope(samples, now=now, since=growth.window_start, already_open=already_open)
    if recent < min_slope_bytes_per_second:
        return None  # it grew, but it has stopped: a load that has finished
    if not already_open and not growing_now(samples, now=now, slope=growth.slope):
        return None  # it grew, but the newest bucket is flat: a load that has finished
    if not already_open and not new_height(growth, held_before_bytes):
        return None  # back to a level it held before: the rise of a long cycle
    return _finding(growth, recent, gpu_total_bytes, gpu_free_bytes)


def _finding(
    growth: Growth, recent: float, gpu_total_bytes: int | None, gpu_free_bytes: int | None
) -> Finding:
    held, slope = growth.newest_bytes, current_rate(growth, recent)
    if gpu_free_bytes is not None:
        basis: str | None = "free"
        exhaust: float | None = gpu_free_bytes / slope
    elif gpu_total_bytes is not None:
        basis, exhaust = "total", max(gpu_total_bytes - held, 0) / slope
    else:
        basis, exhaust = None, None
    per_minute = growth.slope * 60 / 2**20
    summary = (
        f"memory grew {per_minute:.1f} MiB/min for {format_seconds(growth.window_seconds)}"
        f" to {format_bytes(held)}, {format_bytes(growth.clearance_bytes)} above its"
        " earlier peaks"
    )
    if exhaust is not None:
        bound = "" if basis == "free" else " at most"
        summary += f"; the GPU is full in{bound} {format_seconds(exhaust)} at this rate"
    return Finding(
        kind="runaway",
        reason="leak",
        summary=summary,
        held_bytes=held,
        evidence={
            **growth.evidence(),
            "recent_slope_bytes_per_second": recent,
            "exhaust_rate_bytes_per_second": slope,
            "time_to_exhaust_seconds": exhaust,
            "exhaust_basis": basis,
            "gpu_free_bytes": gpu_free_bytes,
            "gpu_total_bytes": gpu_total_bytes,
        },
    )
