"""The reaper's steady clock: history, deadlines and idle stretches survive wall-clock steps.

The wall clock steps (an NTP ``makestep``, a VM restore, ``date -s``). Measured on it,
an idle stretch or a warning's deadline can shrink, grow or stop moving, and a history
fed by it drops or misplaces polls. So the reaper times everything on
``CLOCK_BOOTTIME`` (monotonic, counts suspend, the same for every process of one boot)
plus a fixed offset taken once from the wall clock, so that its values read like epoch
seconds near the start and stay comparable between the agent and ``gpuwatch reap``
(the agent serves its offset with the history). Epoch seconds are used only for what a
person reads and for the server (audit rows' ``at``, events' times).
"""

from __future__ import annotations

import time
from collections.abc import Callable


def boottime() -> float:
    """Seconds since boot, suspend included (``CLOCK_BOOTTIME``)."""
    return time.clock_gettime(time.CLOCK_BOOTTIME)


class SteadyClock:
    """``boottime() + offset``: steady, in seconds that read like epoch seconds.

    ``offset`` is the wall clock minus boot time when not given (taken once). Two
    steady clocks with the same offset agree, whatever the wall clock did since.
    """

    def __init__(
        self,
        offset: float | None = None,
        *,
        source: Callable[[], float] = boottime,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self._source = source
        self.offset = wall() - source() if offset is None else offset

    def __call__(self) -> float:
        return self._source() + self.offset


def steady_clock(wall: Callable[[], float]) -> Callable[[], float]:
    """The reaper's steady clock for a process whose wall clock is ``wall``.

    The real wall clock (:func:`time.time`) gets a :class:`SteadyClock`. Any other
    clock is one a test injected (a fake clock that only moves when told) and is
    already steady: it is used as it is, so the test drives history and deadlines.
    """
    if wall is time.time:
        return SteadyClock()
    return wall


def wall_offset(steady: Callable[[], float], wall: Callable[[], float]) -> float:
    """How far the wall clock is ahead of ``steady`` now (add it to show a steady time
    as epoch seconds, subtract it to bring an epoch time onto ``steady``)."""
    return wall() - steady()
