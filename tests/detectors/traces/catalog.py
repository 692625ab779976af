"""The trace corpus itself: each trace as signals over time, with the verdicts it must
and may produce. ``generate.py`` renders them into the JSON files beside it.

Expectations follow the documented guarantees at the server's defaults (60 s buckets,
a 30 min leak window, 1 h idle window, 2 h filling horizon); docs/detection.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

GIB, MIB, MINUTE, HOUR = 2**30, 2**20, 60.0, 3600.0
# Not on a bucket edge, so bucket starts and trace offsets do not line up by accident.
T0 = 1_700_000_017.3
H100, H200 = 80 * GIB, 141 * GIB
# The documented delays at the defaults (docs/detection.md): a leak from a holder's
# first poll is flagged within the 30 min window plus three buckets; once growth stops
# the verdict ends within half a window plus three buckets.
LEAK_BY = 33 * MINUTE
CLOSE_WITHIN = 18 * MINUTE
IDLE_BY = 62 * MINUTE
HORIZON = 2 * HOUR

Signal = Callable[[float], float | None]


@dataclass
class Proc:
    pid: int
    used: Signal  # bytes at a time after T0; None: not listed
    sm: Callable[[float], float | None] = lambda t: 0.5
    start: float = 0.0
    noise_mib: float = 0.0
    dead_after: float | None = None


@dataclass
class Trace:
    name: str
    description: str
    duration: float
    poll: float
    procs: list[Proc]
    expect: dict[str, object] = field(default_factory=dict)
    drift: float = 0.0
    gaps: list[tuple[float, float]] = field(default_factory=list)
    total: int = H100
    unattributed: Signal | None = None


# --- waveforms (bytes over time) ------------------------------------------------------


def saw(period: float, low: float, high: float, phase: float = 0.0) -> Signal:
    return lambda t: low + (high - low) * (((t + phase) % period) / period)


def square(period: float, low: float, high: float, phase: float = 0.0) -> Signal:
    return lambda t: high if ((t + phase) % period) < period / 2 else low


def sine(period: float, low: float, high: float, phase: float = 0.0) -> Signal:
    return lambda t: low + (high - low) * (0.5 + 0.5 * math.sin(2 * math.pi * (t + phase) / period))


def linear(start: float, per_minute: float, since: float = 0.0) -> Signal:
    return lambda t: start + per_minute * max(0.0, t - since) / MINUTE


def plus(*signals: Signal) -> Signal:
    return lambda t: sum(s(t) or 0.0 for s in signals)


def between(signal: Signal, start: float, end: float = math.inf) -> Signal:
    return lambda t: signal(t) if start <= t < end else None


def flat(value: float) -> Signal:
    return lambda t: value


# --- verdict windows ------------------------------------------------------------------


def must_from(start: float, end: float) -> dict[str, list[list[float]]]:
    """Required from ``start`` to the end; allowed from 0 (growth may show earlier)."""
    return {"must": [[start, end]], "may": [[0.0, end]]}


def filling_for(
    used: Signal, per_minute: float, total: int, end: float, by: float = LEAK_BY
) -> dict[str, list[list[float]]]:
    """The GPU verdict for memory ``used`` growing ``per_minute``: filling up is allowed
    once the free memory would last less than 1.1 horizons at that rate, and required
    (from ``by`` on) once it lasts less than 0.9 of one; never if neither happens."""

    def first(limit: float) -> float:
        grid = (i * MINUTE for i in range(int(end / MINUTE) + 1))
        rate = per_minute / MINUTE
        return next((t for t in grid if (total - (used(t) or 0)) / rate <= limit), math.inf)

    may_from, must_from_ = first(1.1 * HORIZON), first(0.9 * HORIZON)
    spec: dict[str, list[list[float]]] = {}
    if may_from <= end:
        spec["may"] = [[may_from, end]]
    if max(by, must_from_ + 2 * MINUTE) <= end:
        spec["must"] = [[max(by, must_from_ + 2 * MINUTE), end]]
    return spec


def key(proc: Proc) -> str:
    return f"{proc.pid}@{proc.start:g}"


# --- the corpus -----------------------------------------------------------------------


def leaks() -> list[Trace]:
    """Holders that grow: each must be a leak within the documented delay."""
    traces = []
    for rate, poll, minutes, total, noise in [
        (0.1, 5.0, 120, H100, 32),
        (0.5, 15.0, 90, H100, 64),
        (1.0, 1.0, 50, H100, 64),
        (2.0, 5.0, 38, H100, 128),
        (4.0, 15.0, 34, H200, 256),
    ]:
        proc = Proc(101, linear(2 * GIB, rate * GIB), noise_mib=noise)
        end = minutes * MINUTE
        traces.append(
            Trace(
                f"leak-{rate:g}gib-per-min-poll-{poll:g}s",
                f"Linear leak of {rate:g} GiB/min from 2 GiB, noise sigma {noise} MiB.",
                end,
                poll,
                [proc],
                {
                    "leak": {key(proc): must_from(LEAK_BY, end)},
                    "filling": filling_for(proc.used, rate * GIB, total, end),
                },
                total=total,
            )
        )
    late = Proc(102, linear(6 * GIB, 1 * GIB, since=40 * MINUTE), noise_mib=64)
    under_saw = Proc(103, plus(linear(2 * GIB, 0.5 * GIB), saw(120, 0, 4 * GIB)), noise_mib=32)
    wobble = Proc(104, plus(linear(2 * GIB, 2 * GIB), sine(45, 0, 1 * GIB)), noise_mib=32)
    chunks = Proc(105, lambda t: 4 * GIB + 2 * GIB * (t // (5 * MINUTE)), noise_mib=16)
    end = 100 * MINUTE
    return [
        *traces,
        Trace(
            "leak-after-40min-flat",
            "Flat at 6 GiB for 40 min, then 1 GiB/min: found about half a window after onset.",
            end,
            5.0,
            [late],
            {
                "leak": {key(late): {"must": [[58 * MINUTE, end]], "may": [[40 * MINUTE, end]]}},
                "filling": filling_for(late.used, GIB, H100, end, by=58 * MINUTE),
            },
        ),
        Trace(
            "leak-0.5gib-per-min-under-4gib-saw-tooth",
            "0.5 GiB/min under a 4 GiB, 2 min saw-tooth: its floor clears the earlier peaks.",
            90 * MINUTE,
            5.0,
            [under_saw],
            {
                "leak": {key(under_saw): must_from(LEAK_BY, 90 * MINUTE)},
                "filling": filling_for(
                    plus(under_saw.used, flat(4 * GIB)), GIB / 2, H100, 90 * MINUTE
                ),
            },
        ),
        Trace(
            "leak-2gib-per-min-under-45s-sine",
            "2 GiB/min under a 1 GiB, 45 s sine, polled every 15 s.",
            36 * MINUTE,
            15.0,
            [wobble],
            {
                "leak": {key(wobble): must_from(LEAK_BY, 36 * MINUTE)},
                "filling": filling_for(wobble.used, 2 * GIB, H100, 36 * MINUTE),
            },
        ),
        Trace(
            "steps-2gib-every-5min",
            "An allocator growing in 2 GiB chunks every 5 min: a leak, since it keeps stepping.",
            end,
            15.0,
            [chunks],
            {
                "leak": {key(chunks): must_from(LEAK_BY, end)},
                "filling": filling_for(chunks.used, 0.4 * GIB, H100, end),
            },
        ),
    ]


def not_leaks() -> list[Trace]:
    """Holders whose memory changes without growing, or stops growing."""
    step = Proc(201, lambda t: 8 * GIB if t < 40 * MINUTE else 20 * GIB, noise_mib=32)
    warm = Proc(202, lambda t: 2 * GIB + GIB * min(t, 45 * MINUTE) / MINUTE, noise_mib=32)
    first = Proc(203, between(flat(10 * GIB), 0, 60 * MINUTE), noise_mib=16)
    second = Proc(203, between(flat(30 * GIB), 65 * MINUTE), start=65 * MINUTE, noise_mib=16)
    end = 180 * MINUTE
    return [
        Trace(
            "single-step-second-model",
            "8 GiB, then a second model loaded at 40 min (20 GiB), then flat: one step.",
            end,
            5.0,
            [step],
        ),
        Trace(
            "warm-up-then-plateau",
            "Grows 1 GiB/min for 45 min, then flat: may be a leak while it grows, not after.",
            150 * MINUTE,
            5.0,
            [warm],
            {
                "leak": {key(warm): {"may": [[0.0, 45 * MINUTE + CLOSE_WITHIN]]}},
                "filling": {"may": [[0.0, 45 * MINUTE + CLOSE_WITHIN]]},
            },
        ),
        Trace(
            "pid-reuse",
            "PID 203 holds 10 GiB for an hour and exits; a new process reuses PID 203 with 30 GiB.",
            end,
            15.0,
            [first, second],
        ),
    ]


def periodic() -> list[Trace]:
    """Memory that breathes, at periods from 5 s to 30 min: never a leak, never filling."""
    shapes = {"saw": saw, "square": square, "sine": sine}
    cases = [
        # (shape, period s, poll s, drift s, minutes, low GiB, high GiB)
        ("saw", 5, 1, 0, 60, 18, 58),
        ("saw", 5, 5, 0, 120, 18, 58),
        ("saw", 5, 15, 0, 180, 18, 58),
        ("saw", 10, 5, 0, 120, 4, 12),
        ("saw", 60, 1, 0, 90, 18, 58),
        ("saw", 60, 5, 0, 120, 18, 58),
        ("saw", 60, 15, 0, 180, 18, 58),
        ("saw", 60, 15, 0.002, 360, 18, 58),
        ("saw", 300, 5, 0, 180, 10, 30),
        ("saw", 300, 15, 0, 180, 10, 30),
        ("saw", 1800, 1, 0, 180, 18, 58),
        ("saw", 1800, 5, 0, 240, 18, 58),
        ("saw", 1800, 15, 0, 240, 18, 58),
        ("square", 120, 5, 0, 120, 8, 40),
        ("square", 1200, 1, 0, 150, 8, 40),
        ("sine", 600, 15, 0, 180, 20, 60),
        ("sine", 1790, 5, 0, 240, 20, 60),
    ]
    traces = []
    for i, (shape, period, poll, drift, minutes, low, high) in enumerate(cases):
        wave = shapes[shape](period, low * GIB, high * GIB, phase=0.37 * period)
        proc = Proc(300 + i, wave, noise_mib=64)
        cadence = f"{poll + drift:g}s"
        traces.append(
            Trace(
                f"{shape}-{period:g}s-poll-{cadence}-{low}-{high}gib",
                f"{shape} between {low} and {high} GiB, period {period:g} s, "
                f"polled every {cadence} (jitter ±3%); flat on average.",
                minutes * MINUTE,
                poll,
                [proc],
                drift=drift,
            )
        )
    jobs = [
        Proc(320, saw(90, 10 * GIB, 30 * GIB), noise_mib=64),
        Proc(321, square(300, 12 * GIB, 36 * GIB, phase=40), noise_mib=64),
    ]
    traces.append(
        Trace(
            "gpu-two-jobs-breathing",
            "Two jobs saw-toothing (90 s) and stepping (5 min) on one GPU: together they "
            "repeat every 15 min, and their peaks come within 14 GiB of full.",
            180 * MINUTE,
            5.0,
            jobs,
        )
    )
    return traces


def holders() -> list[Trace]:
    """Idle, busy, dead and full holders."""
    notebook = Proc(401, flat(20 * GIB), sm=lambda t: 0.0)
    bursty = Proc(402, flat(20 * GIB), sm=lambda t: 0.3 if t % (20 * MINUTE) < 30 else 0.0)
    quiet_at = 60 * MINUTE
    settles = Proc(
        403, flat(16 * GIB), sm=lambda t: 0.3 if t < quiet_at and t % (20 * MINUTE) < 30 else 0.0
    )
    gappy = Proc(404, flat(12 * GIB), sm=lambda t: 0.0)
    dies = Proc(405, flat(10 * GIB), sm=lambda t: 0.5 if t < 60 * MINUTE else None)
    dies.dead_after = 60 * MINUTE
    full = [Proc(406, flat(50 * GIB), noise_mib=64), Proc(407, flat(29.5 * GIB), noise_mib=64)]
    end, long_end = 180 * MINUTE, 240 * MINUTE
    gap = (90 * MINUTE, 105 * MINUTE)
    return [
        Trace(
            "idle-notebook",
            "A forgotten notebook: 20 GiB, no SM activity for 3 h.",
            end,
            15.0,
            [notebook],
            {"idle": {key(notebook): {"must": [[IDLE_BY, end]], "may": [[59 * MINUTE, end]]}}},
        ),
        Trace(
            "idle-with-short-bursts",
            "20 GiB, a 30 s burst of work every 20 min: never idle for a whole hour.",
            end,
            5.0,
            [bursty],
        ),
        Trace(
            "bursts-then-idle",
            "Bursts every 20 min for the first hour, then nothing: idle an hour after the last.",
            end,
            5.0,
            [settles],
            {"idle": {key(settles): {"must": [[102 * MINUTE, end]], "may": [[99 * MINUTE, end]]}}},
        ),
        Trace(
            "idle-with-gaps",
            "12 GiB idle; the agent is down from 90 to 105 min and misses a few single polls: "
            "a long gap is unknown time, so idleness is proven again only an hour after it.",
            long_end,
            15.0,
            [gappy],
            {
                "idle": {
                    key(gappy): {
                        "must": [[IDLE_BY, gap[0]], [gap[1] + IDLE_BY, long_end]],
                        "may": [[59 * MINUTE, gap[0]], [gap[1] + 59 * MINUTE, long_end]],
                    }
                }
            },
            gaps=[gap, (30 * MINUTE, 30 * MINUTE + 20), (150 * MINUTE, 150 * MINUTE + 40)],
        ),
        Trace(
            "dead-pid",
            "Works for an hour and dies; NVML keeps listing its 10 GiB context, SM unknown.",
            end,
            15.0,
            [dies],
            {"orphan": {key(dies): {"must": [[61 * MINUTE, end]], "may": [[60 * MINUTE, end]]}}},
        ),
        Trace(
            "flat-full-gpu",
            "Two busy jobs hold 79.5 of 80 GiB, flat: full, but not filling up.",
            end,
            5.0,
            full,
        ),
    ]


def filling() -> list[Trace]:
    """GPUs whose used memory rises toward full (or only slowly)."""
    steady = Proc(501, flat(20 * GIB), noise_mib=64)
    fast = Proc(502, linear(10 * GIB, 0.3 * GIB), noise_mib=64)
    slow = Proc(503, linear(5 * GIB, 0.1 * GIB), noise_mib=32)
    creeping = Proc(504, linear(8 * GIB, 0.05 * GIB), noise_mib=16)
    end = 90 * MINUTE
    return [
        Trace(
            "gpu-filling-two-growers",
            "80 GiB GPU: one flat job, one growing 0.3 GiB/min, one 0.1 GiB/min; full in ~2 h.",
            end,
            5.0,
            [steady, fast, slow],
            {
                "filling": must_from(LEAK_BY, end),
                "leak": {key(fast): must_from(LEAK_BY, end), key(slow): must_from(LEAK_BY, end)},
            },
            unattributed=flat(512 * MIB),
        ),
        Trace(
            "gpu-creeping-far-from-full",
            "Grows 0.05 GiB/min with 70 GiB free: a leak, but the GPU is not full for 20 h.",
            end,
            15.0,
            [creeping],
            {"leak": {key(creeping): must_from(LEAK_BY, end)}},
        ),
    ]


def catalog() -> list[Trace]:
    return [*leaks(), *not_leaks(), *periodic(), *holders(), *filling()]
