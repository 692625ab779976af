"""When the agent polls and when it pushes: fixed deadlines on a monotonic clock.

Both schedules are grids fixed at their start, ``start + n * interval``; a deadline
never moves because a poll ran long or a timer woke late. Before this, each wait was
measured from the previous poll's end and the push deadline was checked against a time
taken after the poll, so with a 15 s push interval the gaps between pushed snapshots
were 15 or 20 s, and with 1 s, 35-40% of them were 2 s.

Polls (:class:`PollSchedule`): a poll is due at each slot of the grid. A poll that
overruns into the next slot does not shift the grid: the next poll starts at once, for
the latest slot that has come, and later ones fall back on the grid. Slots that passed
entirely during one overrunning poll are not made up: one catch-up poll, never a burst.

Pushes (:class:`PushSchedule`): a poll's snapshot is offered to the server when the
poll's *scheduled* time (its slot, not when it finished) reaches the push deadline.
Push deadlines are a grid of their own, starting at the first offered poll's slot. A
poll up to half a poll interval before a deadline counts as reaching it, so that two
grids that meet (5 s polls, 15 s pushes) never miss by a rounding error, and a push
interval that is not a multiple of the poll interval is served by the nearest poll.
After an offer the deadline moves to the first one past that poll, so a push missed
while polls were failing is made up once, not in a burst.

Times are seconds on one monotonic clock (``time.monotonic`` in production).
"""

from __future__ import annotations

import math


class PollSchedule:
    """Poll slots at ``start + n * interval_seconds``."""

    def __init__(self, interval_seconds: float, *, start: float) -> None:
        if interval_seconds <= 0:
            raise ValueError("interval_seconds must be positive")
        self._interval = interval_seconds
        self._start = start
        self._slot = 0  # the next slot not yet claimed

    @property
    def next_at(self) -> float:
        """When the next poll is due."""
        return self._slot_time(self._slot)

    def claim(self, now: float) -> float:
        """Take the poll due at ``now`` and return its scheduled time (a slot <= ``now``).

        Normally that is :attr:`next_at`. When ``now`` is past one or more further
        slots (the previous poll overran them), it is the latest of those: the older
        ones are skipped rather than polled back to back.
        """
        reached = math.floor((now - self._start) / self._interval)
        # max(): a rounding error in the division must never move the grid backwards.
        slot = max(self._slot, reached)
        self._slot = slot + 1
        return self._slot_time(slot)

    def _slot_time(self, slot: int) -> float:
        # Multiplied, not summed, so no rounding error builds up over a long run.
        return self._start + slot * self._interval


class PushSchedule:
    """Push deadlines every ``interval_seconds``, met by polls' scheduled times.

    ``tolerance_seconds`` is how far before a deadline a poll still meets it; the
    agent passes half its poll interval.
    """

    def __init__(self, interval_seconds: float, *, tolerance_seconds: float) -> None:
        if interval_seconds <= 0:
            raise ValueError("interval_seconds must be positive")
        self._interval = interval_seconds
        self._tolerance = tolerance_seconds
        self._origin: float | None = None  # the first offered poll's scheduled time
        self._next = 0  # index of the next deadline on the grid

    def due(self, scheduled: float) -> bool:
        """Whether the snapshot of the poll scheduled at ``scheduled`` is to be offered."""
        if self._origin is None:
            return True
        deadline = self._origin + self._next * self._interval
        return scheduled >= deadline - self._tolerance

    def offered(self, scheduled: float) -> None:
        """Record that the poll scheduled at ``scheduled`` was offered; move the deadline
        to the first one that poll did not already meet."""
        if self._origin is None:
            self._origin = scheduled
        met = math.floor((scheduled + self._tolerance - self._origin) / self._interval)
        self._next = max(self._next + 1, met + 1)
