"""Idle holders: memory held with no SM activity for a whole trailing window.

The forgotten notebook is the typical case: a kernel keeps 20 GiB of weights on a
shared GPU for hours and computes nothing. Only *known* samples can prove idleness:
``sm_ratio is None`` (NVML could not say) and gaps between samples longer than
``max_gap_seconds`` (the agent was down, the host rebooted) are unknown time, and
unknown time is never counted as idle.
"""

from __future__ import annotations

from collections.abc import Sequence

from gpuwatch.detectors._format import format_bytes, format_seconds
from gpuwatch.detectors.buckets import bucket_width
from gpuwatch.detectors.types import Finding, Sample


def detect_idle(
    samples: Sequence[Sample],
    *,
    now: float,
    window_seconds: float,
    min_bytes: int,
    max_gap_seconds: float,
) -> Finding | None:
    """Return an ``idle`` finding if the holder was idle over all of ``[now - window, now]``.

    A sample is idle when it holds at least ``min_bytes`` and ``sm_ratio == 0``. The
    trailing run of idle samples must start at or before the window's start, follow
    each other at most ``max_gap_seconds`` apart, and the newest must be at most
    ``max_gap_seconds`` before ``now`` (so a holder that stopped reporting is not
    called idle on stale data), counted like the gaps between samples: from the
    newest bucket's start to the start of the bucket that holds ``now``, i.e. with one
    bucket (the narrowest step between samples, at most half of ``max_gap_seconds``)
    of slack (:func:`_stamp_slack`). Samples after ``now`` are ignored. Times are
    seconds.

    Evidence: ``idle_seconds`` (length of the idle run up to ``now``, which may exceed
    the window), ``held_bytes`` (newest sample), ``idle_since`` (epoch seconds of the
    first idle sample of the run), ``window_seconds`` and ``samples``.
    """
    known = sorted((s for s in samples if s.t <= now), key=lambda s: s.t)
    if not known or now - known[-1].t > max_gap_seconds + _stamp_slack(known, max_gap_seconds):
        return None
    # Walk back from the newest sample while samples stay idle and close together;
    # the run's first sample is where provable idleness begins.
    run_start = len(known)
    for i in range(len(known) - 1, -1, -1):
        if not _is_idle(known[i], min_bytes):
            break
        if run_start < len(known) and known[run_start].t - known[i].t > max_gap_seconds:
            break
        run_start = i
    if run_start == len(known):
        return None
    idle_since = known[run_start].t
    idle_seconds = now - idle_since
    if idle_seconds < window_seconds:
        return None
    held = known[-1].used_bytes
    return Finding(
        kind="idle",
        reason="idle",
        summary=(
            f"holds {format_bytes(held or 0)} with no SM activity "
            f"for {format_seconds(idle_seconds)}"
        ),
        held_bytes=held,
        evidence={
            "idle_seconds": idle_seconds,
            "held_bytes": held,
            "idle_since": idle_since,
            "window_seconds": window_seconds,
            "samples": len(known) - run_start,
        },
    )


def _stamp_slack(known: Sequence[Sample], max_gap_seconds: float) -> float:
    """How much older than ``max_gap_seconds`` the newest sample may be: one bucket.

    A bucket is stamped with its start, and its polls come up to a bucket later; the
    gaps between samples are counted stamp to stamp, so ``now`` (a poll in a later
    bucket) is too. Counting from the stamp to ``now`` itself asked more of the newest
    bucket than of any other: with one push a bucket and ±30 % jitter, or two pushes a
    bucket and two missed in a row, an empty bucket put ``now`` more than two buckets
    after the newest stamp, though no poll gap reached ``max_gap_seconds``, and an open
    idle verdict closed for a bucket and opened again as a second event. The bucket is
    the narrowest step between the samples (a missing bucket only widens a step; raw
    polls give a poll interval), and never more than half of ``max_gap_seconds``,
    which the server sets to at least two buckets.
    """
    return min(bucket_width(s.t for s in known), max_gap_seconds / 2)


def _is_idle(sample: Sample, min_bytes: int) -> bool:
    # ``sm_ratio == 0`` exactly: NVML reports integer percent, so any activity at all
    # shows as >= 0.01, and None (not supported / not visible) is unknown, not idle.
    return (
        sample.used_bytes is not None
        and sample.used_bytes >= min_bytes
        and sample.sm_ratio is not None
        and sample.sm_ratio == 0
    )
