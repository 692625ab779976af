"""Classes of memory traces found by the detector audit, each over its parameters:

* memory that grew in a few steps (or a short ramp) and then stopped, under poll
  noise or a training loop's breathing, never *opens* a leak or filling-up verdict
  after it stopped (rule 3: a verdict opens only while the memory rises). Before the
  fix, "rising now" compared a bucket's peak with an earlier floor, so the noise or
  breathing inside one bucket looked like growth and verdicts opened minutes after
  the last allocation;
* a steady process beside a real grower is not named a culprit of filling up: its
  lowest poll wanders between two spans by its noise alone;
* a cycle longer than the window (a job that builds up for most of an hour and frees
  at the end of each epoch) opens no verdict once its first cycle is in the history the
  server keeps: each rise only climbs back to where the last one went. A leak under
  such a cycle, whose every top is higher than the last, is still found.

Times are injected; polls go through ``bucketize`` and the detectors run at every
bucket close, as the server runs them (test_properties.verdicts).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator

import pytest
from detectors.test_properties import (
    INTERVAL,
    MIN_SLOPE,
    T0,
    WAVES,
    WINDOW,
    periodic,
    polls,
    verdicts,
)

from gpuwatch.detectors import Finding, Sample, bucketize, detect_filling, detect_leak
from gpuwatch.detectors.buckets import bucket_start
from gpuwatch.detectors.growth import highest_floor

MIB, GIB, MINUTE = 2**20, 2**30, 60.0
Signal = Callable[[float], float]


def _load(shape: str, stop_minute: float) -> Signal:
    """Memory that grows by one of ``shape`` and is flat from ``stop_minute`` on."""

    def used(t: float) -> float:
        m = t / MINUTE
        if shape == "two steps 10 min apart":
            return 10 * GIB + 2 * GIB * ((m >= stop_minute - 10) + (m >= stop_minute))
        if shape == "two chunks 3 min apart":
            return 10 * GIB + 8 * GIB * ((m >= stop_minute - 3) + (m >= stop_minute))
        if shape == "one load over 8 min":
            return 10 * GIB + 20 * GIB * min(max(m - stop_minute + 8, 0) / 8, 1)
        raise AssertionError(shape)

    return used


def _breathing(period: float, amplitude: float) -> Signal:
    return lambda t: amplitude * ((t % period) / period)


_SHAPES = ("two steps 10 min apart", "two chunks 3 min apart", "one load over 8 min")
# (noise MiB, saw-tooth period s, its amplitude GiB) the loads are polled under.
_RIPPLES = ((32, 0, 0), (128, 0, 0), (0, 30, 2), (0, 120, 1), (16, 45, 4), (0, 60, 2))
# Still open (see docs/detection.md, rule 3): a saw-tooth whose period is the bucket's,
# polled every 15 s, moves a bucket's floor by a quarter of its amplitude whenever a
# poll's jitter crosses the drop, which reads as a rise. Strict: it must fail until fixed.
_KNOWN_GAP = ((0, 60, 2), "two steps 10 min apart")


@pytest.mark.parametrize(
    ("noise_mib", "period", "amplitude_gib", "shape"),
    [
        pytest.param(
            *ripple,
            shape,
            marks=[pytest.mark.xfail(strict=True, reason="known gap")]
            if (ripple, shape) == _KNOWN_GAP
            else [],
        )
        for ripple in _RIPPLES
        for shape in _SHAPES
    ],
)
def test_a_load_that_stopped_never_opens_a_verdict_afterwards(
    shape: str, noise_mib: int, period: float, amplitude_gib: float
) -> None:
    stop = 50.0
    load = _load(shape, stop)
    ripple = _breathing(period, amplitude_gib * GIB) if period else (lambda t: 0.0)
    for every in (5.0, 15.0):
        samples = polls(
            lambda t: load(t) + ripple(t),
            every=every,
            minutes=110,
            seed=int(stop + every + noise_mib + period),
            noise=noise_mib * MIB,
        )
        for t, leak, filling in verdicts(samples):
            # The verdict may open only while the memory rises (up to the stop, plus
            # the buckets that straddle it); after that, none may open.
            if t > (stop + 1) * MINUTE:
                assert leak is None, f"leak at {t / 60:.1f} min ({every} s): {leak.summary}"
                assert filling is None, f"filling at {t / 60:.1f} min ({every} s)"


def _gpu_verdicts(procs: dict[int, list[Sample]], total: int) -> list[dict[str, object]]:
    """The evidence of every filling-up verdict, at every GPU bucket close."""
    times = sorted({s.t for ss in procs.values() for s in ss})
    used_at: dict[float, int] = {}
    for ss in procs.values():
        for s in ss:
            used_at[s.t] = used_at.get(s.t, 0) + (s.used_bytes or 0)
    gpu = [Sample(t, used_at[t], None) for t in times]
    return [
        finding.evidence
        for _, finding, _ in _filling_replay(gpu, procs, total=total)
        if finding is not None
    ]


def _filling_replay(
    gpu: list[Sample],
    procs: dict[int, list[Sample]],
    *,
    total: int,
    window: float = WINDOW,
) -> Iterator[tuple[float, Finding | None, bool]]:
    """(minutes after the first poll, the filling-up verdict, whether it opened there)
    at every bucket close of the GPU's polls ``gpu``, judged as the server judges a GPU:
    its window, the window's length of history before it, and the poll at hand."""
    gpu_buckets = bucketize(gpu, INTERVAL)
    proc_buckets = {pid: bucketize(ss, INTERVAL) for pid, ss in procs.items()}
    previous, open_ = None, False
    for s in gpu:
        bucket = bucket_start(s.t, INTERVAL)
        if previous is not None and bucket > previous:
            since = s.t - window - 2 * INTERVAL
            finding = detect_filling(
                [b for b in gpu_buckets if since <= b.t < bucket],
                now=s.t,
                total_bytes=total,
                free_bytes=total - (s.used_bytes or 0),
                horizon_seconds=7200.0,
                min_slope_bytes_per_second=MIN_SLOPE,
                min_duration_seconds=window,
                processes={
                    pid: [b for b in bb if since <= b.t < bucket]
                    for pid, bb in proc_buckets.items()
                },
                already_open=open_,
                held_before_bytes=highest_floor(
                    [b for b in gpu_buckets if since - window <= b.t < since]
                ),
                now_bytes=s.used_bytes,
            )
            yield (s.t - gpu[0].t) / MINUTE, finding, finding is not None and not open_
            open_ = finding is not None
        previous = bucket


@pytest.mark.parametrize("seed", range(6))
def test_a_steady_process_beside_a_grower_is_not_named_a_culprit(seed: int) -> None:
    # 0.5 GiB/min fills an 80 GiB GPU within the horizon; two steady jobs whose polls
    # wander by 32 MiB beside it. Before the fix a steady job was named a culprit in
    # about one verdict of ten (its floor in the current span a few MiB above the
    # reference span's).
    rng = random.Random(seed)
    every = 15.0

    def noisy(level: Signal, sigma: float, s: int) -> list[Sample]:
        return polls(level, every=every, minutes=60, seed=s, noise=sigma)

    procs = {
        1: noisy(lambda t: 20 * GIB + 0.5 * GIB * t / MINUTE, 32 * MIB, rng.randrange(2**16)),
        2: noisy(lambda t: 10 * GIB, 32 * MIB, rng.randrange(2**16)),
        3: noisy(lambda t: 30 * GIB, 32 * MIB, rng.randrange(2**16)),
    }
    # The same schedule for every process, as one agent polls them together.
    times = [s.t for s in procs[1]]
    for pid in (2, 3):
        procs[pid] = [
            Sample(t, s.used_bytes, s.sm_ratio) for t, s in zip(times, procs[pid], strict=False)
        ]
    evidences = _gpu_verdicts(procs, 80 * GIB)
    assert evidences, "the GPU fills within the horizon: a verdict is due"
    for e in evidences:
        named = [c["pid"] for c in e["culprits"]]  # type: ignore[attr-defined]
        assert named == [1], named


# Periods past the window (30 min) up to what the history before it holds (the server
# keeps an hour): each shape, several phases, levels and poll rates.
@pytest.mark.parametrize("period_minutes", [35, 41, 47, 53, 58])
@pytest.mark.parametrize("wave", sorted(WAVES))
@pytest.mark.parametrize(
    ("low_gib", "high_gib", "noise_mib"), [(2, 6, 0), (10, 40, 32), (30, 75, 8)]
)
def test_a_cycle_longer_than_the_window_is_no_leak_after_its_first_cycle(
    period_minutes: int, wave: str, low_gib: float, high_gib: float, noise_mib: int
) -> None:
    period = period_minutes * MINUTE
    phase = (period_minutes % 7) / 7
    level = periodic(wave, period, phase, low_gib * GIB, high_gib * GIB)
    for every in (5.0, 15.0):
        samples = polls(level, every=every, minutes=240, seed=period_minutes, noise=noise_mib * MIB)
        # The first rise cannot be told from a leak: nothing was held before it. Once a
        # whole cycle (its top, then its drop) has been seen, no verdict may stand.
        settled = period + 3 * INTERVAL
        for t, leak, filling in verdicts(samples):
            if t > settled:
                assert leak is None, f"leak at {t / 60:.0f} min ({every} s): {leak.summary}"
                assert filling is None, f"filling at {t / 60:.0f} min ({every} s)"


@pytest.mark.parametrize("period_minutes", [40, 55])
def test_a_leak_under_a_long_cycle_is_still_found(period_minutes: int) -> None:
    # A 40- or 55-minute cycle of 4 GiB whose floor also rises 2.5 GiB a cycle: every
    # rise ends well above the last top. (Tops 1.5 GiB higher each cycle are not found:
    # the current floor lags the top by what the cycle climbs in the window's last span;
    # docs/detection.md says so.)
    period = period_minutes * MINUTE
    cycle = periodic("saw", period, 0.0, 0.0, 4 * GIB)
    samples = polls(
        lambda t: 10 * GIB + cycle(t) + 2.5 * GIB * t / period,
        every=15.0,
        minutes=240,
        seed=period_minutes,
        noise=16 * MIB,
    )
    flagged = [t for t, leak, _ in verdicts(samples) if leak is not None and t > 2 * period]
    assert flagged, "a leak whose every top is higher than the last went unreported"


def _filling_opened(samples: list[Sample], *, window: float, total: int) -> list[float]:
    """Minutes (after the first poll) at which a one-process GPU's filling-up verdict
    opened."""
    replay = _filling_replay(samples, {1: samples}, total=total, window=window)
    return [minutes for minutes, _, opened in replay if opened]


# A model loaded over a few minutes, then held: through a 9-minute window (the alert
# benchmark's, for fast warnings) the closed buckets still rise for a minute or two
# after it levelled off, and the filling-up verdict opened on the plateau (a warning,
# a critical alert at 93 % full). Every bucket alignment, loads of 3 to 8 minutes.
@pytest.mark.parametrize("offset", [0.0, 7.0, 15.0, 29.0, 44.0, 58.0])
@pytest.mark.parametrize(("minutes", "to_gib"), [(3, 40), (5, 60), (5, 70), (8, 70)])
@pytest.mark.parametrize("window", [540.0, 1800.0])
def test_a_warm_up_that_levelled_off_never_opens_filling_up(
    offset: float, minutes: int, to_gib: int, window: float
) -> None:
    start = 40 * MINUTE + offset  # the bucket the load ends in moves with the offset
    stop = start + minutes * MINUTE

    def used(t: float) -> float:
        return 4 * GIB + to_gib * GIB * min(max(t - start, 0.0) / (stop - start), 1.0)

    for every in (5.0, 15.0):
        samples = polls(used, every=every, minutes=80, seed=minutes + to_gib, noise=8 * MIB)
        opened = _filling_opened(samples, window=window, total=80 * GIB)
        # Within a quarter of a bucket of the stop the poll at hand cannot tell yet.
        grace = stop + INTERVAL / 4 + every
        assert [m for m in opened if m * MINUTE > grace] == [], (every, opened)


# An allocator that grows in chunks, flat between them, is filling the GPU: its verdict
# opens at the bucket that holds a chunk (the poll at hand is past it), well before full.
@pytest.mark.parametrize("offset", [0.0, 20.0, 41.0])
@pytest.mark.parametrize(("every_minutes", "chunk_gib"), [(2, 1), (5, 2), (8, 4)])
def test_growth_in_chunks_opens_filling_up_before_the_gpu_is_full(
    offset: float, every_minutes: int, chunk_gib: int
) -> None:
    def used(t: float) -> float:
        return 4 * GIB + chunk_gib * GIB * ((t + offset) // (every_minutes * MINUTE))

    total = 80 * GIB
    full_at = (total - 4 * GIB) / (chunk_gib * GIB) * every_minutes  # minutes
    samples = polls(used, every=15.0, minutes=int(full_at), seed=every_minutes, noise=16 * MIB)
    opened = _filling_opened(samples, window=WINDOW, total=total)
    assert opened and opened[0] < full_at - 30, (opened, full_at)


# Pushes of half a bucket, the first of each bucket late in it (the demo at --speed 3:
# 1 s pushes, 2 s buckets). "Still climbing at the poll at hand" counted from the
# bucket's start asked for more growth than two pushes add, so the verdict never opened
# when the agent's phase was late (one demo run in three). The floor is the bucket's
# first poll: growth counts from there, whatever the phase.
@pytest.mark.parametrize("phase", [0.0, 0.3, 0.6, 0.8, 0.95])
def test_a_fill_pushed_twice_a_bucket_opens_filling_up_at_any_phase(phase: float) -> None:
    every = INTERVAL / 2
    rate = GIB / MINUTE  # 80 GiB full 76 min in: within the two-hour horizon throughout
    first = bucket_start(T0, INTERVAL) + INTERVAL
    times = [first + (n + phase) * every for n in range(int(50 * MINUTE / every))]
    samples = [Sample(t, int(4 * GIB + rate * (t - first)), 0.5) for t in times]
    opened = _filling_opened(samples, window=WINDOW, total=80 * GIB)
    due = (WINDOW + 3 * INTERVAL) / MINUTE
    assert opened and opened[0] <= due, (phase, opened)


# A 0.5 GiB/min leak under a ripple about 2 GiB from trough to crest, judged over a 9 min
# window (bench/detection.py's trace 375, at 52.4 min): one bucket's floor sank below
# the one before, and no split's current floor cleared its reference peak, so the open
# verdict lapsed for a bucket and a second event opened a minute later (10 traces of 200
# in the bench). The memory stands 3 GiB above the window's first peak; an open verdict
# continues on that, a new one still needs a split.
_RIPPLED_LEAK_MIB = (
    (12759, 14224), (12937, 15004), (13419, 15546), (14102, 15981), (14816, 16627),
    (14794, 17153), (15725, 17342), (16293, 18019), (16463, 18614), (17232, 19123),
)  # fmt: skip


def test_an_open_leak_under_a_ripple_as_high_as_a_split_s_growth_does_not_lapse() -> None:
    first = bucket_start(T0, INTERVAL)
    window = [
        Sample(first + i * INTERVAL, floor * MIB, 0.5, peak * MIB)
        for i, (floor, peak) in enumerate(_RIPPLED_LEAK_MIB)
    ]
    now = window[-1].t + INTERVAL + 24.0

    def judged(already_open: bool) -> Finding | None:
        return detect_leak(
            window,
            now=now,
            gpu_total_bytes=80 * GIB,
            gpu_free_bytes=None,
            min_slope_bytes_per_second=MIN_SLOPE,
            min_duration_seconds=540.0,
            already_open=already_open,
        )

    assert judged(already_open=False) is None  # no split clears: it would not open here
    kept = judged(already_open=True)
    assert kept is not None and kept.evidence["clearance_bytes"] > 2 * GIB  # type: ignore[operator]


@pytest.mark.xfail(strict=True, reason="known gap: one bucket late under an aliased ripple")
def test_a_leak_under_an_aliased_ripple_is_found_within_the_documented_delay() -> None:
    # Found by the linear-growth property with another draw of its own parameter space:
    # 1 GiB/min from 10 min on, under a 5 s saw-tooth a quarter of the window's growth
    # high (7.5 GiB), polled every 9.8125 s. The polls alias it into a 4.4-minute wave,
    # longer than the two-bucket stretches "still rising" compares (rule 3), and the
    # verdict comes at 34.5 min, a bucket past the documented 33 (stop 27's peak-based
    # rule gave it in time). Strict: it fails the day this is fixed.
    per_second = GIB / MINUTE
    ripple = periodic("saw", 5.0, 0.3, 0, 0.25 * per_second * WINDOW)
    begin = 10 * MINUTE

    def used(t: float) -> float:
        return per_second * max(0.0, t - begin) + ripple(t)

    samples = polls(used, every=9.8125, minutes=60, seed=0, noise=16 * MIB)
    due = WINDOW + 3 * INTERVAL  # the documented delay from a holder's first poll
    late = [t for t, leak, _ in verdicts(samples) if t >= due and leak is None]
    assert late == [], f"no leak at {[round(t / 60, 1) for t in late]} min"
