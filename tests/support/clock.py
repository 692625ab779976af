"""The one fake clock every test injects: seconds that move only when a test says so.

Used for epoch clocks (``time.time``) and monotonic ones (``time.monotonic``) alike;
the starting value is the caller's choice.
"""

from __future__ import annotations


class FakeClock:
    """A callable clock: ``clock()`` is ``clock.now``; :meth:`advance` moves it."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
