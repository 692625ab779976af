"""A neighbour restarted under a new PID beside a GPU that fills (the detect2 audit).

The server passes the GPU's bucket samples and the live processes' own; the old PID is
gone, the new one reloads from nothing. Every restart leaves a dip in the GPU's floors:
a restart every W or less left one in every window, so filling_up never opened (H1),
and a reload spread over minutes closed an open verdict and opened a second (H2)."""

from __future__ import annotations

import random

import pytest
from detectors.test_properties import INTERVAL, MIN_SLOPE, T0, WINDOW

from gpuwatch.detectors import Finding, Sample, bucketize, detect_filling
from gpuwatch.detectors.buckets import bucket_start

MIB, GIB, MINUTE = 2**20, 2**30, 60.0
TOTAL = 80 * GIB


def _restarting(
    every_minutes: float, ramp_seconds: float, minutes: float
) -> dict[int, list[Sample]]:
    """A 5 GiB process growing 256 MiB/min beside a steady 25 GiB job restarted under a
    new PID every ``every_minutes`` (down 20 s, then reloading over ``ramp_seconds``)."""
    rng = random.Random(7)
    procs: dict[int, list[Sample]] = {}
    for n in range(int(minutes * MINUTE / 15) + 1):
        t = n * 15 + rng.uniform(-0.45, 0.45)
        grower = 5 * GIB + t / MINUTE * 256 * MIB + rng.gauss(0, 8 * MIB)
        procs.setdefault(900, []).append(Sample(T0 + t, int(grower), 0.5))
        k = int(t // (every_minutes * MINUTE))
        into = t - k * every_minutes * MINUTE
        if k == 0 or into >= 20:
            up = 1.0 if ramp_seconds == 0 or k == 0 else min(1.0, (into - 20) / ramp_seconds)
            job = 25 * GIB * up + rng.gauss(0, 8 * MIB)
            procs.setdefault(1000 + k, []).append(Sample(T0 + t, max(0, int(job)), 0.5))
    return procs


def _verdicts(procs: dict[int, list[Sample]]) -> list[tuple[float, Finding | None]]:
    """(minute, filling verdict) at every GPU bucket close, with the live PIDs only."""
    by_time: dict[float, dict[int, int]] = {}
    for pid, ss in procs.items():
        for s in ss:
            by_time.setdefault(s.t, {})[pid] = s.used_bytes or 0
    gpu = [Sample(t, sum(held.values()), None) for t, held in sorted(by_time.items())]
    gpu_buckets = bucketize(gpu, INTERVAL)
    proc_buckets = {pid: bucketize(ss, INTERVAL) for pid, ss in procs.items()}
    previous, open_, out = None, False, []
    for s in gpu:
        bucket = bucket_start(s.t, INTERVAL)
        if previous is not None and bucket > previous:
            since = s.t - WINDOW - 2 * INTERVAL
            finding = detect_filling(
                [b for b in gpu_buckets if since <= b.t < bucket],
                now=s.t,
                total_bytes=TOTAL,
                free_bytes=TOTAL - (s.used_bytes or 0),
                horizon_seconds=7200.0,
                min_slope_bytes_per_second=MIN_SLOPE,
                min_duration_seconds=WINDOW,
                processes={
                    pid: [b for b in proc_buckets[pid] if since <= b.t < bucket]
                    for pid in procs
                    if pid in by_time[s.t]
                },
                already_open=open_,
                now_bytes=s.used_bytes,
            )
            out.append(((s.t - T0) / MINUTE, finding))
            open_ = finding is not None
        previous = bucket
    return out


@pytest.mark.parametrize("ramp_seconds", [0.0, 90.0, 180.0])
@pytest.mark.parametrize("every_minutes", [10.0, 20.0, 30.0, 45.0])
def test_a_restarting_neighbour_neither_hides_nor_splits_a_fill(
    every_minutes: float, ramp_seconds: float
) -> None:
    verdicts = _verdicts(_restarting(every_minutes, ramp_seconds, 170))
    given = [m for m, f in verdicts if f is not None]
    # Full at about 200 min; without restarts the verdict opens at about 78 min (time
    # to full 2 h). It must open before the last hour, and stay open: one event.
    assert given and given[0] < 140, given[:1]
    assert all(f is not None for m, f in verdicts if m >= given[0]), [
        m for m, f in verdicts if m >= given[0] and f is None
    ]
    # Nor does it open early on the reload's own rise: the time to full at opening is
    # within the horizon only because the GPU really is that close to full.
    first = next(f for _, f in verdicts if f is not None)
    assert first.evidence["time_to_full_seconds"] > 95 * MINUTE  # type: ignore[operator]


# Not fixed (docs/detection.md, filling_up): with a reload spread over 90 to 180 s, the
# new PID is still named beside the grower in some windows; crediting the gone PID's
# level instead of its floor broke the test_filling budget case, and was left out.
@pytest.mark.xfail(reason="known gap: restarted job with a slow reload named a culprit")
@pytest.mark.parametrize("ramp_seconds", [90.0, 180.0])
def test_a_restarted_job_with_a_slow_reload_is_not_named(ramp_seconds: float) -> None:
    for _, f in _verdicts(_restarting(45.0, ramp_seconds, 170)):
        if f is not None:
            named = [c["pid"] for c in f.evidence["culprits"]]  # type: ignore[union-attr]
            assert named[:1] == [900], named
