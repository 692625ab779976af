"""PyTorch allocator reports sent by ``gpuwatch.torch`` from inside training processes.

NVML sees only what the driver gave a process. The caching allocator inside it knows
more: how much is really allocated, how much is cached but free (fragmentation), and
the peak. ``gpuwatch.torch`` POSTs those figures to the agent's ``/torch`` endpoint
(a :class:`~gpuwatch.wire.TorchReport`); this store keeps the latest per (pid, device)
until they go stale, so the sampler can attach them to the matching
:class:`~gpuwatch.snapshot.GpuProcess`.

A report names its GPU by UUID when the sender knows it (``device_uuid``), and is then
found by that UUID only: its ``device_index`` is the sender's guess, and PyTorch's
device ordinal is not NVML's index under ``CUDA_VISIBLE_DEVICES`` or CUDA's
fastest-first order. A report without a UUID (an older ``gpuwatch.torch``) is found by
its index, as before.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from gpuwatch.snapshot import TorchAllocatorStats
from gpuwatch.wire import TorchReport, gpu_uuid_key

# Reports older than this are dropped: the reporter sends every ~10 s by default, so
# a minute of silence means the process stopped reporting (or exited).
STALE_AFTER_SECONDS = 60.0
# Bound on distinct (pid, device) entries, so a misbehaving client cannot grow memory.
MAX_ENTRIES = 4096


# Where a report says its GPU is: ("uuid", gpu_uuid_key(UUID)) or ("index", n).
DeviceKey = tuple[str, str | int]


@dataclass
class _Entry:
    stats: TorchAllocatorStats
    received_at: float


def device_key(report: TorchReport) -> DeviceKey:
    """The report's GPU: its UUID when it sent one, else its index."""
    if report.device_uuid is not None:
        return ("uuid", gpu_uuid_key(report.device_uuid))
    return ("index", report.device_index)


class TorchReports:
    """Latest allocator figures per (pid, device), thread-safe, bounded, expiring."""

    def __init__(self, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: dict[tuple[int, DeviceKey], _Entry] = {}
        self.received_total = 0

    def record(self, report: TorchReport) -> None:
        stats = TorchAllocatorStats(
            allocated_bytes=report.allocated_bytes,
            reserved_bytes=report.reserved_bytes,
            reserved_unallocated_bytes=report.reserved_unallocated_bytes,
            peak_allocated_bytes=report.peak_allocated_bytes,
            reported_at=report.reported_at,
        )
        now = self._clock()
        with self._lock:
            self.received_total += 1
            self._entries[(report.pid, device_key(report))] = _Entry(stats, now)
            if len(self._entries) > MAX_ENTRIES:
                self._expire(now)
                while len(self._entries) > MAX_ENTRIES:  # still full: evict the oldest
                    oldest = min(self._entries, key=lambda k: self._entries[k].received_at)
                    del self._entries[oldest]

    def get(
        self,
        pid: int,
        device_index: int,
        *,
        start_time: float | None,
        uuids: tuple[str, ...] = (),
    ) -> TorchAllocatorStats | None:
        """The latest fresh report for ``pid`` on the GPU NVML lists as ``device_index``
        with UUIDs ``uuids`` (the GPU's, and its MIG instances'), if any.

        A report sent before the process started belongs to an earlier process that
        had the same PID, so it is ignored.
        """
        with self._lock:
            self._expire(self._clock())
            entry = self._find(pid, device_index, uuids)
        if entry is None:
            return None
        if start_time is not None and entry.stats.reported_at < start_time:
            return None
        return entry.stats

    def _find(self, pid: int, device_index: int, uuids: tuple[str, ...]) -> _Entry | None:
        # The caller holds the lock. The newest of the matching reports wins (a
        # process may have sent both forms across an upgrade).
        keys: list[DeviceKey] = [("uuid", gpu_uuid_key(u)) for u in uuids]
        keys.append(("index", device_index))
        found = [e for e in (self._entries.get((pid, k)) for k in keys) if e is not None]
        return max(found, key=lambda e: e.received_at, default=None)

    def _expire(self, now: float) -> None:
        stale = [k for k, e in self._entries.items() if now - e.received_at > STALE_AFTER_SECONDS]
        for key in stale:
            del self._entries[key]
