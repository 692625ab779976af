"""An event on its way to the server, as its sender (:mod:`gpuwatch.agent.push`) settles it.

Its own module so that the push path, which every agent runs, needs nothing of the
reaper's (whose policy imports the detectors) to hand one out.
"""

from __future__ import annotations

import threading


class EventDelivery:
    """One event on its way to the server: pending until the sender settles it,
    ``delivered`` (stored by the server) or not (refused, dropped, or given up)."""

    def __init__(self) -> None:
        self._settled = threading.Event()
        self.delivered = False

    def settle(self, *, delivered: bool) -> None:
        self.delivered = delivered
        self._settled.set()

    @property
    def pending(self) -> bool:
        return not self._settled.is_set()

    def join(self, timeout: float | None = None) -> None:
        """Wait until it is settled (at most ``timeout`` seconds)."""
        self._settled.wait(timeout)

    def is_alive(self) -> bool:
        """Still pending: a thread's word, so a caller may wait for it like one."""
        return self.pending
