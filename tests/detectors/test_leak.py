"""detect_leak on traces: a real leak is flagged with the right rate; breathing memory is not."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuwatch.detectors import Finding, Sample, bucketize, detect_leak
from gpuwatch.detectors.leak import MAX_SAMPLES

MIB = 2**20
GIB = 2**30
MINUTE = 60.0
T0 = 1_700_000_000.0
MIN_SLOPE = 64 * 2**10  # the server's default, 3.75 MiB/min
MIN_DURATION = 15 * MINUTE
LEAK_RATE = 50 * MIB / MINUTE  # bytes per second


def leak(
    samples: list[Sample], *, free: int | None = 10 * GIB, total: int | None = None
) -> Finding | None:
    now = max((s.t for s in samples), default=T0)
    return detect_leak(
        samples,
        now=now,
        gpu_total_bytes=total,
        gpu_free_bytes=free,
        min_slope_bytes_per_second=MIN_SLOPE,
        min_duration_seconds=MIN_DURATION,
    )


def trace(minutes: float, every: float, used_at: Callable[[float], float]) -> list[Sample]:
    """Samples every ``every`` s for ``minutes``; ``used_at(elapsed_seconds)`` gives bytes."""
    count = int(minutes * MINUTE / every)
    return [Sample(T0 + i * every, int(used_at(i * every)), 0.5) for i in range(count + 1)]


def noise(seed: int, amplitude: int) -> Callable[[], int]:
    rng = random.Random(seed)
    return lambda: rng.randint(-amplitude, amplitude)


def saw_tooth(elapsed: float, *, low: int, high: int, period: float) -> float:
    """Memory that climbs from ``low`` to ``high`` over each ``period`` s, then drops back."""
    return low + (high - low) * ((elapsed % period) / period)


def test_leak_of_50_mib_per_minute_is_flagged_with_its_rate_and_time_to_full() -> None:
    jitter = noise(1, 8 * MIB)
    samples = trace(30, 10, lambda e: 2 * GIB + LEAK_RATE * e + jitter())
    finding = leak(samples, free=6 * GIB)
    assert finding is not None
    assert (finding.kind, finding.reason) == ("runaway", "leak")
    evidence = finding.evidence
    assert evidence["slope_mib_per_minute"] == pytest.approx(50, rel=0.05)
    assert evidence["slope_bytes_per_second"] == pytest.approx(LEAK_RATE, rel=0.05)
    # 6 GiB free at 50 MiB/min: about 123 minutes.
    assert evidence["time_to_exhaust_seconds"] == pytest.approx(6 * GIB / LEAK_RATE, rel=0.05)
    assert evidence["exhaust_basis"] == "free"
    assert evidence["window_seconds"] == pytest.approx(30 * MINUTE)
    assert evidence["r_squared"] == pytest.approx(1.0, abs=0.01)
    assert evidence["monotonic_fraction"] == 1.0
    assert finding.held_bytes == samples[-1].used_bytes
    assert "MiB/min for 30.0 min" in finding.summary
    assert "GPU is full in 2.0 h" in finding.summary


def test_without_free_memory_time_to_full_is_an_upper_bound_from_the_total() -> None:
    samples = trace(30, 10, lambda e: 2 * GIB + LEAK_RATE * e)
    finding = leak(samples, free=None, total=80 * GIB)
    assert finding is not None
    held = samples[-1].used_bytes or 0
    expected = (80 * GIB - held) / LEAK_RATE
    assert finding.evidence["time_to_exhaust_seconds"] == pytest.approx(expected, rel=1e-6)
    assert finding.evidence["exhaust_basis"] == "total"
    assert "at most" in finding.summary


def test_without_free_or_total_the_leak_is_still_flagged() -> None:
    finding = leak(trace(30, 10, lambda e: 2 * GIB + LEAK_RATE * e), free=None)
    assert finding is not None
    assert finding.evidence["time_to_exhaust_seconds"] is None


def test_training_loop_saw_toothing_between_10_and_14_gib_is_not_a_leak() -> None:
    def loop(e: float) -> float:
        return saw_tooth(e, low=10 * GIB, high=14 * GIB, period=2 * MINUTE)

    two_hours = trace(120, 5, loop)
    assert leak(two_hours) is None
    # Also on a trailing 30 min, where spans are shorter than the period.
    assert leak([s for s in two_hours if s.t >= two_hours[-1].t - 30 * MINUTE]) is None


def test_leak_under_a_saw_tooth_is_found_by_its_rising_floor() -> None:
    def loop(e: float) -> float:
        return saw_tooth(e, low=10 * GIB, high=14 * GIB, period=2 * MINUTE) + LEAK_RATE * e

    finding = leak(trace(120, 5, loop))
    assert finding is not None
    assert finding.evidence["slope_mib_per_minute"] == pytest.approx(50, rel=0.05)


def test_noisy_flat_memory_is_not_a_leak() -> None:
    jitter = noise(2, 256 * MIB)
    assert leak(trace(60, 10, lambda e: 8 * GIB + jitter())) is None


def test_one_step_up_is_not_sustained_growth() -> None:
    # A second model loaded halfway through: memory jumps once, then stays.
    assert leak(trace(60, 10, lambda e: 8 * GIB if e < 30 * MINUTE else 12 * GIB)) is None


def test_trace_shorter_than_the_minimum_duration_is_not_judged() -> None:
    assert leak(trace(10, 5, lambda e: 2 * GIB + LEAK_RATE * e)) is None


def test_growth_slower_than_the_minimum_slope_is_not_reported() -> None:
    slow = MIN_SLOPE / 2
    assert leak(trace(60, 10, lambda e: 2 * GIB + slow * e)) is None


def test_unknown_samples_are_skipped() -> None:
    samples = trace(30, 10, lambda e: 2 * GIB + LEAK_RATE * e)
    holes = [Sample(s.t, None, None) if i % 3 == 0 else s for i, s in enumerate(samples)]
    finding = leak(holes)
    assert finding is not None
    assert finding.evidence["samples"] == sum(s.used_bytes is not None for s in holes)


def test_only_the_newest_samples_are_considered() -> None:
    samples = trace(MAX_SAMPLES * 2 / 60, 1, lambda e: 2 * GIB + LEAK_RATE * e)
    finding = leak(samples)
    assert finding is not None
    assert finding.evidence["samples"] == MAX_SAMPLES
    assert finding.evidence["window_start"] == samples[-MAX_SAMPLES].t


# --- properties ---------------------------------------------------------------------

traces = st.lists(
    st.tuples(st.floats(0, 7200, allow_nan=False), st.integers(0, 64 * GIB)),
    min_size=16,
    max_size=200,
)


def as_samples(points: list[tuple[float, int]], offset: int = 0) -> list[Sample]:
    return [Sample(T0 + t, used + offset, None) for t, used in points]


def slope_of(finding: Finding | None) -> object:
    return None if finding is None else finding.evidence["slope_bytes_per_second"]


@settings(max_examples=150, deadline=None)
@given(traces, st.integers(0, 64 * GIB))
def test_constant_offset_does_not_change_the_slope(
    points: list[tuple[float, int]], offset: int
) -> None:
    assert slope_of(leak(as_samples(points))) == slope_of(leak(as_samples(points, offset)))


@settings(max_examples=150, deadline=None)
@given(traces, st.randoms(use_true_random=False))
def test_input_order_does_not_matter(points: list[tuple[float, int]], rng: random.Random) -> None:
    samples = as_samples(points)
    shuffled = samples[:]
    rng.shuffle(shuffled)
    assert leak(shuffled) == leak(samples)


@settings(max_examples=100, deadline=None)
@given(
    st.floats(MIN_SLOPE * 1.01, 100 * MIB),
    st.integers(0, 40 * GIB),
    st.floats(5, 60),
)
def test_steady_linear_growth_is_flagged_with_its_slope(
    rate: float, start: int, every: float
) -> None:
    finding = leak(trace(60, every, lambda e: start + rate * e))
    assert finding is not None
    assert finding.evidence["slope_bytes_per_second"] == pytest.approx(rate, rel=0.01)


@settings(max_examples=150, deadline=None)
@given(traces)
def test_memory_that_never_grows_is_never_a_leak(points: list[tuple[float, int]]) -> None:
    ordered = sorted(points)
    values = sorted((used for _, used in ordered), reverse=True)
    falling = [(t, used) for (t, _), used in zip(ordered, values, strict=True)]
    assert leak(as_samples(falling)) is None


# --- the growth evidence -------------------------------------------------------------


def bucketed(samples: list[Sample]) -> list[Sample]:
    return bucketize(samples, 60)


def trailing(samples: list[Sample], minutes: float) -> list[Sample]:
    return [s for s in samples if s.t >= samples[-1].t - minutes * MINUTE]


def test_a_found_leak_agrees_with_every_number_of_its_evidence() -> None:
    finding = leak(bucketed(trace(40, 5, lambda e: 2 * GIB + LEAK_RATE * e)))
    assert finding is not None
    e = finding.evidence
    assert e["current_floor_bytes"] > e["reference_peak_bytes"]  # type: ignore[operator]
    assert e["clearance_bytes"] == e["net_growth_bytes"] - e["envelope_bytes"]  # type: ignore[operator]
    assert e["r_squared"] >= e["r_squared_min"]  # type: ignore[operator]
    assert e["monotonic_fraction"] >= e["monotonic_fraction_min"]  # type: ignore[operator]
    assert e["confidence"] == pytest.approx(1.0, abs=0.1)
    assert e["period_bound_seconds"] == e["window_seconds"]


def test_the_issues_saw_tooth_between_18_and_58_gib_is_never_a_leak() -> None:
    # A 60 s saw-tooth pushed every 15.002 s: the polls' phase creeps, so the bucket
    # floors walk upward for hours. They never rise above the earlier peaks.
    polls = [
        Sample(
            T0 + i * 15.002, int(saw_tooth(i * 15.002, low=18 * GIB, high=58 * GIB, period=60)), 0.9
        )
        for i in range(4 * 240)
    ]
    buckets = bucketed(polls)
    for end in range(30, len(buckets)):
        window = [b for b in buckets[: end + 1] if b.t >= buckets[end].t - MIN_DURATION - 120]
        assert leak(window) is None


def test_an_allocator_that_keeps_stepping_leaks_and_one_step_does_not() -> None:
    chunks = trace(60, 15, lambda e: 4 * GIB + 2 * GIB * (e // (5 * MINUTE)))
    assert leak(bucketed(chunks)) is not None
    once = trace(60, 15, lambda e: 4 * GIB + (2 * GIB if e > 31 * MINUTE else 0))
    for minutes in (20, 30, 45, 60):
        assert leak(bucketed(trailing(once, minutes))) is None


def test_a_warm_up_is_no_longer_a_leak_once_it_has_levelled_off() -> None:
    def warm_up(e: float) -> float:
        return 2 * GIB + LEAK_RATE * 4 * min(e, 30 * MINUTE)

    ramp = bucketed(trace(90, 5, warm_up))
    assert leak([s for s in ramp if s.t <= T0 + 30 * MINUTE]) is not None
    # Just over half a window after it levelled off, the floors no longer follow a line.
    levelled = [s for s in ramp if s.t <= T0 + 47 * MINUTE]
    assert leak(trailing(levelled, 31)) is None


def test_a_leak_under_a_saw_tooth_is_found_once_its_floor_clears_the_earlier_peaks() -> None:
    def loop(e: float) -> float:
        return saw_tooth(e, low=10 * GIB, high=14 * GIB, period=2 * MINUTE) + 4 * LEAK_RATE * e

    finding = leak(bucketed(trace(60, 5, loop)))
    assert finding is not None
    assert finding.evidence["slope_mib_per_minute"] == pytest.approx(200, rel=0.05)
