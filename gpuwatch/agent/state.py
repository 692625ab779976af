"""What the running agent knows between polls, shared by the poll loop and the exporter."""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field

from gpuwatch.nvml.library import NvmlErrorCounts
from gpuwatch.snapshot import HostSnapshot


@dataclass
class AgentState:
    """The latest snapshot and the agent's own counters. Thread-safe.

    The poll loop writes; scrapes and ``/snapshot`` read. A scrape never polls NVML
    itself: it renders the latest poll, so scrape cost does not depend on the driver.
    What is exported is :attr:`current`: after a failed poll the previous one is stale,
    and stale GPU figures are never served (the series are absent until a poll
    succeeds; the agent's own health metrics say why).
    """

    nvml_errors: NvmlErrorCounts = field(default_factory=NvmlErrorCounts)
    _latest: HostSnapshot | None = None
    _polls: Counter[str] = field(default_factory=Counter)
    _last_failed: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def record_poll(self, snapshot: HostSnapshot) -> None:
        with self._lock:
            self._latest = snapshot
            self._last_failed = False
            self._polls["success"] += 1

    def record_failure(self) -> None:
        with self._lock:
            self._last_failed = True
            self._polls["failure"] += 1

    @property
    def latest(self) -> HostSnapshot | None:
        """The newest successful poll, however old (for context such as OOM evidence)."""
        with self._lock:
            return self._latest

    @property
    def current(self) -> HostSnapshot | None:
        """The newest poll if it succeeded; None after a failed one (nothing to export)."""
        with self._lock:
            return None if self._last_failed else self._latest

    def poll_counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._polls)
