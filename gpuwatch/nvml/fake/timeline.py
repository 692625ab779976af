"""Values that change over scenario time: memory held, SM busy, watts, degrees.

A timeline is a pure function of ``t``, the scenario seconds since the shape started
(the scenario's start for a GPU, the process's ``start`` for a process). Four shapes,
written in TOML as:

=============================================  =========================================
``20`` or ``"20GiB"``                          constant
``{ linear = [from, to], over = "30m" }``      ramps from ``from`` to ``to``, then holds ``to``
``{ sawtooth = [low, high], period = "2m" }``  rises ``low`` -> ``high`` each period, then drops
``{ steps = [["0s", a], ["5m", b]] }``         holds each value from its time on (``a`` before the first)
=============================================  =========================================

Every shape stays within the values it was written with, so :meth:`bounds` lets the
scenario reader check ranges (0..100 for percentages) once, at load time. Each shape
also knows its :meth:`integral` from 0 to ``t`` in closed form (watts -> joules for the
energy counter), and whether it never decreases (:func:`never_decreases`), which a
counter such as an ECC error count must not.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from gpuwatch.quantities import parse_seconds


@dataclass(frozen=True)
class Constant:
    """The same value at every ``t``."""

    value: float

    def at(self, t: float) -> float:
        return self.value

    def bounds(self) -> tuple[float, float]:
        return (self.value, self.value)

    def integral(self, t: float) -> float:
        return self.value * max(0.0, t)


@dataclass(frozen=True)
class Linear:
    """``start`` at ``t <= 0``, ``end`` from ``t >= over`` seconds, a straight line between."""

    start: float
    end: float
    over: float

    def at(self, t: float) -> float:
        if t <= 0 or self.over == 0:
            return self.start if t <= 0 else self.end
        if t >= self.over:
            return self.end
        return self.start + (self.end - self.start) * (t / self.over)

    def bounds(self) -> tuple[float, float]:
        return (min(self.start, self.end), max(self.start, self.end))

    def integral(self, t: float) -> float:
        if t <= 0:
            return 0.0
        ramp = min(t, self.over)
        area = self.start * ramp
        if self.over > 0:
            area += (self.end - self.start) * ramp * ramp / (2 * self.over)
        return area + self.end * max(0.0, t - self.over)


@dataclass(frozen=True)
class Sawtooth:
    """Rises from ``low`` to ``high`` over each ``period`` seconds, then drops back to ``low``."""

    low: float
    high: float
    period: float

    def at(self, t: float) -> float:
        phase = (t % self.period) / self.period
        return self.low + (self.high - self.low) * phase

    def bounds(self) -> tuple[float, float]:
        return (min(self.low, self.high), max(self.low, self.high))

    def integral(self, t: float) -> float:
        if t <= 0:
            return 0.0
        periods, rest = divmod(t, self.period)
        whole = periods * self.period * (self.low + self.high) / 2
        return whole + self.low * rest + (self.high - self.low) * rest * rest / (2 * self.period)


@dataclass(frozen=True)
class Steps:
    """Piecewise constant: ``values[i]`` from ``times[i]`` seconds on; ``values[0]`` before."""

    times: tuple[float, ...]
    values: tuple[float, ...]

    def at(self, t: float) -> float:
        return self.values[max(0, bisect.bisect_right(self.times, t) - 1)]

    def bounds(self) -> tuple[float, float]:
        return (min(self.values), max(self.values))

    def integral(self, t: float) -> float:
        area, since = 0.0, 0.0
        for start, value in zip(self.times[1:], self.values, strict=False):
            if start >= t:
                break
            if start > since:
                area += value * (start - since)
                since = start
        return area + self.at(since) * max(0.0, t - since)


Timeline = Constant | Linear | Sawtooth | Steps


def never_decreases(timeline: Timeline) -> bool:
    """True for shapes that only hold or rise (what a counter's timeline must do)."""
    if isinstance(timeline, Sawtooth):
        return timeline.low == timeline.high
    if isinstance(timeline, Linear):
        return timeline.end >= timeline.start
    if isinstance(timeline, Steps):
        return list(timeline.values) == sorted(timeline.values)
    return True


def parse_timeline(raw: object, scalar: Callable[[object], float]) -> Timeline:
    """Build a timeline from its TOML form; ``scalar`` parses one value (a size, a number).

    Raises ValueError naming what is wrong (the caller adds file and field).
    """
    if not isinstance(raw, Mapping):
        return Constant(scalar(raw))
    shapes = [key for key in ("linear", "sawtooth", "steps") if key in raw]
    if len(shapes) != 1:
        raise ValueError("a timeline table needs exactly one of linear, sawtooth or steps")
    shape = shapes[0]
    allowed = {"linear": {"linear", "over"}, "sawtooth": {"sawtooth", "period"}, "steps": {"steps"}}
    unknown = sorted(set(raw) - allowed[shape])
    if unknown:
        raise ValueError(f"unexpected key {unknown[0]!r} in a {shape} timeline")
    if shape == "steps":
        return _parse_steps(raw["steps"], scalar)
    pair = raw[shape]
    if not isinstance(pair, list) or len(pair) != 2:
        raise ValueError(f"{shape} takes two values, e.g. {shape} = [0, 100]")
    first, second = scalar(pair[0]), scalar(pair[1])
    if shape == "linear":
        if "over" not in raw:
            raise ValueError('linear needs over = DURATION, e.g. over = "30m"')
        return Linear(first, second, parse_seconds(raw["over"]))
    if "period" not in raw:
        raise ValueError('sawtooth needs period = DURATION, e.g. period = "2m"')
    period = parse_seconds(raw["period"])
    if period <= 0:
        raise ValueError("sawtooth period must be longer than 0s")
    return Sawtooth(first, second, period)


def _parse_steps(raw: object, scalar: Callable[[object], float]) -> Steps:
    if not isinstance(raw, list) or not raw:
        raise ValueError('steps takes a list of [time, value] pairs, e.g. [["0s", 1], ["5m", 2]]')
    times: list[float] = []
    values: list[float] = []
    for step in raw:
        if not isinstance(step, list) or len(step) != 2:
            raise ValueError(f"each step is a [time, value] pair, got {step!r}")
        times.append(parse_seconds(step[0]))
        values.append(scalar(step[1]))
    if times != sorted(times):
        raise ValueError("step times must be in increasing order")
    return Steps(tuple(times), tuple(values))
