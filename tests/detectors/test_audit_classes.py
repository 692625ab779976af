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


# A warm-up or an allocator's staircase that levelled off, under a training step's
# breath faster than a bucket (the 2026-12-07 audit): the poll at hand sits anywhere in
# the breath, and compared whole with a bucket's floor it read as growth going on, so
# filling-up opened two to three minutes after the GPU stopped filling (a warning that
# it is full in 36 minutes). Judged less the breath, or by the floors where the breath
# hides it, it may open only while the floors cannot yet show the stop: within the
# newest bucket, and a half more (docs/detection.md).
_BREATHS = ((36.0, 1.5), (50.0, 3.0))  # (period s, GiB): not the audit's own


@pytest.mark.parametrize(("period", "amplitude_gib"), _BREATHS)
@pytest.mark.parametrize("stop_minute", [28.2, 32.0])
def test_a_warm_up_under_a_breath_does_not_open_filling_up_after_it_levelled_off(
    period: float, amplitude_gib: float, stop_minute: float
) -> None:
    start = stop_minute - 14
    breath = _breathing(period, amplitude_gib * GIB)

    def used(t: float) -> float:
        ramp = min(max(t / MINUTE - start, 0.0) / 14, 1.0)
        return 4 * GIB + 30 * GIB * ramp + breath(t)

    samples = polls(used, every=15.0, minutes=stop_minute + 25, seed=int(period), noise=16 * MIB)
    opened = _filling_opened(samples, window=WINDOW, total=80 * GIB)
    grace = stop_minute + 1.5 * INTERVAL / MINUTE + 0.25
    assert [m for m in opened if m > grace] == [], opened


@pytest.mark.parametrize(("period", "amplitude_gib"), _BREATHS)
def test_a_staircase_under_a_breath_does_not_open_filling_up_after_its_last_chunk(
    period: float, amplitude_gib: float
) -> None:
    chunks = ((4, 2), (7, 3), (10, 4), (14, 4), (25, 4), (31.5, 2))  # (minute, GiB)
    breath = _breathing(period, amplitude_gib * GIB)

    def used(t: float) -> float:
        return 4 * GIB + sum(g * GIB for at, g in chunks if t >= at * MINUTE) + breath(t)

    samples = polls(used, every=15.0, minutes=60, seed=int(period) + 1, noise=16 * MIB)
    opened = _filling_opened(samples, window=WINDOW, total=80 * GIB)
    assert [m for m in opened if m > chunks[-1][0] + 1.0] == [], opened


@pytest.mark.parametrize(("period", "amplitude_gib"), _BREATHS)
def test_a_fill_under_a_breath_still_opens_filling_up(period: float, amplitude_gib: float) -> None:
    # The other side of judging the poll less the breath: growth that goes on is found
    # (by the floors where the breath hides the poll), well before the GPU is full.
    breath = _breathing(period, amplitude_gib * GIB)
    samples = polls(
        lambda t: 4 * GIB + 0.5 * GIB * t / MINUTE + breath(t),
        every=15.0,
        minutes=60,
        seed=int(period) + 2,
        noise=16 * MIB,
    )
    opened = _filling_opened(samples, window=WINDOW, total=80 * GIB)
    assert opened and opened[0] <= 40, opened


# Growth that began inside the window (a grower starting beside a steady job): the
# window's robust slope is a blend of the flat part and the rise, about half the rise's
# rate, and the time to full at it was 1.2 to 1.7 times the truth (the 2026-12-07
# audit: "full in 65 min" for 39). Both verdicts project at the current rate.
@pytest.mark.parametrize(("rate_gib", "total_gib"), [(0.7, 80), (2.0, 141)])
def test_time_to_full_follows_growth_that_began_inside_the_window(
    rate_gib: float, total_gib: int
) -> None:
    onset = 12 * MINUTE
    per_second = rate_gib * GIB / MINUTE

    def used(t: float) -> float:
        return 24 * GIB + per_second * max(0.0, t - onset)

    samples = polls(used, every=15.0, minutes=40, seed=3, noise=16 * MIB)
    total = total_gib * GIB
    replay = _filling_replay(samples, {1: samples}, total=total)
    first = next((m, f) for m, f, opened in replay if opened)
    minutes, finding = first
    true_seconds = (total - used(minutes * MINUTE)) / per_second
    said = finding.evidence["time_to_full_seconds"]
    assert said == pytest.approx(true_seconds, rel=0.15), (minutes, said, true_seconds)
    buckets = bucketize(samples, INTERVAL)
    at = samples[-1].t
    leak = detect_leak(
        [b for b in buckets if at - WINDOW - 2 * INTERVAL <= b.t < bucket_start(at, INTERVAL)],
        now=at,
        gpu_total_bytes=total,
        gpu_free_bytes=int(total - used(at - T0)),
        min_slope_bytes_per_second=MIN_SLOPE,
        min_duration_seconds=WINDOW,
    )
    assert leak is not None
    exhaust = leak.evidence["time_to_exhaust_seconds"]
    assert exhaust == pytest.approx((total - used(at - T0)) / per_second, rel=0.15)


# One brief dip under a steady leak (the cache emptied and taken back), or a GPU whose
# steady job restarts under a new PID beside a grower: the single low floor sank the
# window's upward share and r² until it left the window, and the open verdicts closed
# for 30 minutes, the GPU's coming back 10 minutes before full (the 2026-12-07 audit).
# An open verdict looks through a dip the memory comes back from within three buckets.
@pytest.mark.parametrize(("keep", "seconds"), [(0.5, 30.0), (0.65, 100.0)])
def test_a_brief_dip_does_not_close_an_open_leak_or_filling_up(keep: float, seconds: float) -> None:
    dip_at = 47 * MINUTE

    def used(t: float) -> float:
        level = 6 * GIB + 0.8 * GIB * t / MINUTE
        return level * (keep if dip_at <= t < dip_at + seconds else 1.0)

    samples = polls(used, every=15.0, minutes=75, seed=int(seconds), noise=16 * MIB)
    judged = [(t, leak, filling) for t, leak, filling in verdicts(samples) if t > 31 * MINUTE]
    # Open from the first evaluation with a whole window on, and never lapsing.
    assert all(leak is not None for _, leak, _ in judged)
    assert all(filling is not None for _, _, filling in judged)


def _live_filling(procs: dict[int, list[Sample]], total: int) -> list[Finding | None]:
    """The filling-up verdict at every GPU bucket close, given the processes alive at the
    poll at hand only (as the server passes its open lifetimes: a PID that has gone is
    not among them)."""
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
            live = [pid for pid in procs if pid in by_time[s.t]]
            finding = detect_filling(
                [b for b in gpu_buckets if since <= b.t < bucket],
                now=s.t,
                total_bytes=total,
                free_bytes=total - (s.used_bytes or 0),
                horizon_seconds=7200.0,
                min_slope_bytes_per_second=MIN_SLOPE,
                min_duration_seconds=WINDOW,
                processes={
                    pid: [b for b in proc_buckets[pid] if since <= b.t < bucket] for pid in live
                },
                already_open=open_,
                now_bytes=s.used_bytes,
            )
            out.append(finding)
            open_ = finding is not None
        previous = bucket
    return out


# A steady job restarted under a new PID beside a grower, at once or 20 s down: the old
# PID is gone, so not among the processes the server passes, and the new one held its
# 25 GiB from its first poll. It was named the grower of all 25 GiB for as long as the
# verdict stayed open (at once), or the verdict lapsed for half an hour (20 s down).
@pytest.mark.parametrize("down_seconds", [0.0, 20.0])
@pytest.mark.parametrize("restart_minute", [38.0, 52.0])
def test_a_job_restarted_under_a_new_pid_is_not_the_grower(
    down_seconds: float, restart_minute: float
) -> None:
    grower = polls(
        lambda t: 4 * GIB + 0.6 * GIB * t / MINUTE, every=15.0, minutes=90, seed=5, noise=8 * MIB
    )
    restart = restart_minute * MINUTE
    old = [Sample(s.t, 25 * GIB, 0.5) for s in grower if s.t - T0 < restart]
    new = [Sample(s.t, 25 * GIB, 0.5) for s in grower if s.t - T0 >= restart + down_seconds]
    findings = _live_filling({1: grower, 100: old, 200: new}, 80 * GIB)
    named = [
        [c["pid"] for c in f.evidence["culprits"]]  # type: ignore[attr-defined]
        for f in findings
        if f is not None
    ]
    assert named and all(pids == [1] for pids in named), named
    given = [f is not None for f in findings]
    assert all(given[given.index(True) :])  # nor does the restart close the verdict


def test_a_drop_that_lasts_still_closes_an_open_leak_within_four_buckets() -> None:
    # The other side of looking through dips: memory freed for good (the leak fixed and
    # its cache released) closes the verdict, DIP_BUCKETS buckets later than at once.
    freed_at = 50 * MINUTE

    def used(t: float) -> float:
        level = 6 * GIB + 0.8 * GIB * t / MINUTE
        return level * (0.5 if t >= freed_at else 1.0)

    samples = polls(used, every=15.0, minutes=70, seed=9, noise=16 * MIB)
    open_after = [t for t, leak, _ in verdicts(samples) if leak is not None and t > freed_at]
    assert open_after and max(open_after) <= freed_at + 4 * INTERVAL + 15.0, open_after
