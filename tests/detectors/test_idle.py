"""detect_idle on traces: the forgotten notebook, and the ways idleness is not proven."""

from __future__ import annotations

import random

import pytest

from gpuwatch.detectors import Finding, Sample, detect_idle

GIB = 2**30
HOUR = 3600.0
NOW = 1_700_000_000.0
WINDOW = 1 * HOUR
MIN_BYTES = 1 * GIB
MAX_GAP = 300.0


def notebook(hours: float, *, every: float = 60.0, used: int = 20 * GIB) -> list[Sample]:
    """A kernel holding ``used`` bytes with SM at 0, sampled up to NOW."""
    count = int(hours * HOUR / every)
    return [Sample(t=NOW - i * every, used_bytes=used, sm_ratio=0.0) for i in range(count, -1, -1)]


def idle(samples: list[Sample], *, now: float = NOW) -> Finding | None:
    return detect_idle(
        samples, now=now, window_seconds=WINDOW, min_bytes=MIN_BYTES, max_gap_seconds=MAX_GAP
    )


def test_forgotten_notebook_is_idle_for_its_whole_run() -> None:
    finding = idle(notebook(3))
    assert finding is not None
    assert (finding.kind, finding.reason) == ("idle", "idle")
    assert finding.held_bytes == 20 * GIB
    assert finding.evidence["idle_seconds"] == pytest.approx(3 * HOUR)
    assert finding.evidence["idle_since"] == NOW - 3 * HOUR
    assert finding.evidence["held_bytes"] == 20 * GIB
    assert "20.0 GiB" in finding.summary and "3.0 h" in finding.summary


def test_gap_of_unknown_time_inside_the_window_is_not_idle() -> None:
    # The agent was down from 50 to 20 minutes ago: nobody knows what ran then.
    trace = [s for s in notebook(3) if not NOW - 50 * 60 < s.t < NOW - 20 * 60]
    assert idle(trace) is None


def test_gap_before_the_window_still_leaves_it_covered() -> None:
    trace = [s for s in notebook(3) if not NOW - 2.5 * HOUR < s.t < NOW - 2 * HOUR]
    finding = idle(trace)
    assert finding is not None
    assert finding.evidence["idle_seconds"] == pytest.approx(2 * HOUR)


def test_unknown_sm_inside_the_window_is_not_idle() -> None:
    trace = [
        Sample(s.t, s.used_bytes, None) if NOW - 40 * 60 <= s.t <= NOW - 30 * 60 else s
        for s in notebook(3)
    ]
    assert idle(trace) is None


def test_any_activity_inside_the_window_is_not_idle() -> None:
    trace = [Sample(s.t, s.used_bytes, 0.03) if s.t == NOW - 600 else s for s in notebook(3)]
    assert idle(trace) is None


def test_idle_shorter_than_the_window_is_not_reported() -> None:
    assert idle(notebook(0.75)) is None


def test_small_holders_are_ignored() -> None:
    assert idle(notebook(3, used=512 * 2**20)) is None


def test_holder_that_stopped_reporting_is_not_idle_on_stale_data() -> None:
    assert idle(notebook(3), now=NOW + 2 * MAX_GAP) is None


def test_samples_after_now_are_ignored() -> None:
    trace = [*notebook(3), Sample(NOW + 60, 20 * GIB, 0.5)]
    assert idle(trace) is not None


def test_input_order_does_not_matter() -> None:
    trace = notebook(3)
    shuffled = trace[:]
    random.Random(7).shuffle(shuffled)
    assert idle(shuffled) == idle(trace)


def test_empty_trace_is_not_idle() -> None:
    assert idle([]) is None
