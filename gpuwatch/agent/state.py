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
    """

    nvml_errors: NvmlErrorCounts = field(default_factory=NvmlErrorCounts)
    _latest: HostSnapshot | None = None
    _polls: Counter[str] = field(default_factory=Counter)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def record_poll(self, snapshot: HostSnapshot) -> None:
        with self._lock:
            self._latest = snapshot
            self._polls["success"] += 1

    def record_failure(self) -> None:
        with self._lock:
            self._polls["failure"] += 1

    @property
    def latest(self) -> HostSnapshot | None:
        with self._lock:
            return self._latest

    def poll_counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._polls)
