"""Every detector on every trace of the corpus (tests/detectors/traces/), fed as the server
feeds them: raw polls bucketized per process lifetime and per GPU, each trend detector
run at every bucket close over its trailing window, and the per-snapshot detectors on
the poll that closed the bucket. Each trace states which verdicts it must and may
produce (tests/detectors/traces/generate.py explains the format).
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from gpuwatch.detectors import (
    Finding,
    Sample,
    bucketize,
    detect_filling,
    detect_idle,
    detect_leak,
    detect_orphan,
    detect_share,
    detect_unattributed,
)
from gpuwatch.detectors.buckets import bucket_start
from gpuwatch.detectors.growth import (
    CLEARANCE_MIN_BYTES,
    MONOTONIC_MIN,
    R_SQUARED_MIN,
    highest_floor,
)
from gpuwatch.snapshot import Gpu, GpuProcess

TRACES = sorted((Path(__file__).parent / "traces").glob("*.json"))
MIB, GIB = 2**20, 2**30
# The server's defaults (gpuwatch.settings.ServerSettings) the expectations assume.
INTERVAL = 60.0
PUSH = 15.0
LEAK_WINDOW = 1800.0
MIN_SLOPE = 64 * 2**10
IDLE_WINDOW = 3600.0
IDLE_MIN_BYTES = 1 * GIB
HORIZON = 7200.0
SHARE_RATIO = 0.9
UNATTRIBUTED_MIN = 1 * GIB
# What the server keeps of a window before the growth detectors' own
# (findings.trend_window_seconds): the level a verdict must rise past.
HISTORY = max(IDLE_WINDOW, 2 * LEAK_WINDOW) - LEAK_WINDOW

# (verdict, "pid@start" or "gpu") -> [(seconds after t0, finding or None)], one per evaluation
Timeline = dict[tuple[str, str], list[tuple[float, Finding | None]]]


@dataclass
class Lifetime:
    """One process lifetime's polls (by poll index) and the buckets the server makes of them."""

    key: str
    pid: int
    dead_after: float | None
    polls: dict[int, Sample] = field(default_factory=dict)
    buckets: list[Sample] = field(default_factory=list)
    starts: list[float] = field(default_factory=list)

    def bucketize(self) -> None:
        self.buckets = bucketize(self.polls.values(), INTERVAL)
        self.starts = [s.t for s in self.buckets]

    def window(self, since: float, at: float) -> list[Sample]:
        """The closed buckets the server holds at ``at`` that start at or after ``since``."""
        return window(self.buckets, self.starts, since, at)


def window(buckets: list[Sample], starts: list[float], since: float, at: float) -> list[Sample]:
    lo = bisect.bisect_left(starts, since)
    return buckets[lo : bisect.bisect_left(starts, bucket_start(at, INTERVAL))]


def closes(polls: dict[int, Sample]) -> Iterator[tuple[int, float]]:
    """(poll index, time) of each poll that falls into a later bucket than the one before:
    the moments the server runs the trend detectors."""
    previous = None
    for i, sample in polls.items():
        bucket = bucket_start(sample.t, INTERVAL)
        if previous is not None and bucket > previous:
            yield i, sample.t
        previous = bucket


@dataclass
class Replay:
    t0: float
    times: list[float]
    total: int
    lifetimes: list[Lifetime]
    gpu_used: list[int]
    expect: dict[str, Any]

    @classmethod
    def load(cls, path: Path) -> Replay:
        data = json.loads(path.read_text())
        t0 = data["t0"]
        times = [t0 + ms / 1000 for ms in data["t_ms"]]
        gpu_used = [mib * MIB for mib in data["unattributed_mib"] or [0] * len(times)]
        lifetimes = []
        for proc in data["processes"]:
            dead = proc["dead_after_ms"]
            life = Lifetime(
                f"{proc['pid']}@{proc['start_time'] - t0:g}",
                proc["pid"],
                None if dead is None else t0 + dead / 1000,
            )
            for i, (used, sm) in enumerate(zip(proc["used_mib"], proc["sm_percent"], strict=True)):
                if used is not None:
                    gpu_used[i] += used * MIB
                    life.polls[i] = Sample(times[i], used * MIB, None if sm is None else sm / 100)
            life.bucketize()
            lifetimes.append(life)
        return cls(t0, times, data["gpu_total_bytes"], lifetimes, gpu_used, data["expect"])

    def timeline(self) -> Timeline:
        timeline: Timeline = {}
        self._processes(timeline)
        self._gpu(timeline)
        return timeline

    def _processes(self, timeline: Timeline) -> None:
        for life in self.lifetimes:
            leak = None  # open, as the server's event book would know it
            for i, at in closes(life.polls):
                since = at - LEAK_WINDOW - 2 * INTERVAL
                leak = detect_leak(
                    life.window(since, at),
                    held_before_bytes=highest_floor(life.window(since - HISTORY, since)),
                    now=at,
                    gpu_total_bytes=self.total,
                    gpu_free_bytes=self.total - self.gpu_used[i],
                    min_slope_bytes_per_second=MIN_SLOPE,
                    min_duration_seconds=LEAK_WINDOW,
                    already_open=leak is not None,
                )
                idle = detect_idle(
                    life.window(at - IDLE_WINDOW - 2 * INTERVAL, at),
                    now=at,
                    window_seconds=IDLE_WINDOW,
                    min_bytes=IDLE_MIN_BYTES,
                    max_gap_seconds=2 * max(INTERVAL, PUSH),
                )
                poll = life.polls[i]
                alive = life.dead_after is None or at < life.dead_after
                process = GpuProcess(
                    pid=life.pid, used_bytes=poll.used_bytes, sm_ratio=poll.sm_ratio, alive=alive
                )
                orphan = detect_orphan(process)
                for name, finding in (("leak", leak), ("idle", idle), ("orphan", orphan)):
                    timeline.setdefault((name, life.key), []).append((at - self.t0, finding))

    def _gpu(self, timeline: Timeline) -> None:
        polls = {i: Sample(t, self.gpu_used[i], None) for i, t in enumerate(self.times)}
        buckets = bucketize(polls.values(), INTERVAL)
        starts = [s.t for s in buckets]
        filling_open = False  # as the server's event book would know it
        for i, at in closes(polls):
            since = at - LEAK_WINDOW - 2 * INTERVAL
            listed = [life for life in self.lifetimes if i in life.polls]
            filling = detect_filling(
                window(buckets, starts, since, at),
                held_before_bytes=highest_floor(window(buckets, starts, since - HISTORY, since)),
                now_bytes=self.gpu_used[i],
                already_open=filling_open,
                now=at,
                total_bytes=self.total,
                free_bytes=self.total - self.gpu_used[i],
                horizon_seconds=HORIZON,
                min_slope_bytes_per_second=MIN_SLOPE,
                min_duration_seconds=LEAK_WINDOW,
                processes={life.pid: life.window(since, at) for life in listed},
            )
            processes = [
                GpuProcess(pid=life.pid, used_bytes=life.polls[i].used_bytes) for life in listed
            ]
            gpu = Gpu(
                index=0,
                uuid="GPU-corpus",
                memory_total_bytes=self.total,
                memory_used_bytes=self.gpu_used[i],
                processes=processes,
                unattributed_bytes=self.gpu_used[i] - sum(p.used_bytes or 0 for p in processes),
            )
            share = next(
                (f for p in processes if (f := detect_share(p, gpu, share_ratio=SHARE_RATIO))), None
            )
            unattributed = detect_unattributed(gpu, min_bytes=UNATTRIBUTED_MIN)
            filling_open = filling is not None
            for name, finding in (
                ("filling", filling),
                ("share", share),
                ("unattributed", unattributed),
            ):
                timeline.setdefault((name, "gpu"), []).append((at - self.t0, finding))


def _inside(t: float, spans: list[list[float]]) -> bool:
    return any(a <= t <= b for a, b in spans)


def _expectation(replay: Replay, verdict: str, key: str) -> dict[str, list[list[float]]]:
    spec = replay.expect.get(verdict, {})
    return (spec if key == "gpu" else spec.get(key, {})) or {}


def _check_evidence(verdict: str, finding: Finding) -> None:
    """A leak or filling verdict never stands against its own evidence."""
    if verdict not in {"leak", "filling"}:
        return
    e = finding.evidence
    assert e["r_squared"] >= R_SQUARED_MIN  # type: ignore[operator]
    assert e["monotonic_fraction"] >= MONOTONIC_MIN  # type: ignore[operator]
    assert e["clearance_bytes"] > CLEARANCE_MIN_BYTES  # type: ignore[operator]
    assert e["net_growth_bytes"] > e["envelope_bytes"]  # type: ignore[operator]
    assert e["slope_bytes_per_second"] >= MIN_SLOPE  # type: ignore[operator]
    assert 0 <= e["confidence"] <= 1  # type: ignore[operator]
    assert e["period_bound_seconds"] >= LEAK_WINDOW  # type: ignore[operator]


@pytest.mark.parametrize("path", TRACES, ids=[p.stem for p in TRACES])
def test_trace_gives_exactly_its_expected_verdicts(path: Path) -> None:
    replay = Replay.load(path)
    timeline = replay.timeline()
    for (verdict, key), evaluations in timeline.items():
        expect = _expectation(replay, verdict, key)
        must, may = expect.get("must", []), expect.get("may", []) + expect.get("must", [])
        for t, finding in evaluations:
            where = f"{path.stem}: {verdict} of {key} at {t / 60:.1f} min"
            if finding is None:
                assert not _inside(t, must), f"{where}: expected, not given"
                continue
            assert _inside(t, may), f"{where}: unexpected ({finding.summary})"
            _check_evidence(verdict, finding)
    # Every stated expectation names something the replay evaluated.
    for verdict, spec in replay.expect.items():
        keys = ["gpu"] if verdict == "filling" else list(spec)
        assert all((verdict, k) in timeline for k in keys), (verdict, keys)


def test_corpus_is_small_and_covers_the_cases() -> None:
    assert len(TRACES) >= 30 and sum(p.stat().st_size for p in TRACES) < 4 * 2**20
    names = {p.stem for p in TRACES}
    assert "saw-60s-poll-15.002s-18-58gib" in names
    expected = [json.loads(p.read_text())["expect"] for p in TRACES]
    for verdict in ("leak", "idle", "orphan", "filling"):
        assert any(verdict in e for e in expected), verdict
