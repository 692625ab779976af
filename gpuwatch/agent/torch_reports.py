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
fastest-first order. The UUID is resolved against every GPU and MIG instance of the
host (:func:`gpuwatch.wire.find_device`): without its ``GPU-``/``MIG-`` prefix (PyTorch
prints a MIG instance's UUID bare, like a GPU's), CUDA 11's ``MIG-GPU-<uuid>/<gi>/<ci>``,
or a unique prefix (``CUDA_VISIBLE_DEVICES=GPU-8932f937``); one that names no device, or
two, is attached nowhere. A report without a UUID (an older ``gpuwatch.torch``) is found
by its index, as before.

Who may fill it: the exporter takes a report only from its process's owner or root,
and passes the poster's uid (the kernel's word) to :meth:`TorchReports.record`. Each
poster holds at most MAX_ENTRIES_PER_POSTER reports, its oldest going first, and a full
store evicts from its largest poster: a flood of posts from one user (4,096 made-up
PIDs) evicts that user's own reports, not everyone's. A report's ``reported_at`` is
the sender's clock, and the PID-reuse check compares it with a process's start time; it
is kept no later than the report's arrival, so a report dated in the future cannot
pass for one from a process that takes the PID later.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gpuwatch.snapshot import TorchAllocatorStats
from gpuwatch.wire import NamedDevice, TorchReport, find_device, gpu_uuid_key

# Reports older than this are dropped: the reporter sends every ~10 s by default, so
# a minute of silence means the process stopped reporting (or exited).
STALE_AFTER_SECONDS = 60.0
# Bound on distinct (pid, device) entries, so a misbehaving client cannot grow memory.
MAX_ENTRIES = 4096
# Bound on one poster's (uid's) share: no user can evict everyone's reports alone. A
# host of 8 GPUs with 128 reporting processes each stays under it.
MAX_ENTRIES_PER_POSTER = 1024


# Where a report says its GPU is: ("uuid", gpu_uuid_key(UUID)) or ("index", n).
DeviceKey = tuple[str, str | int]


@dataclass
class _Entry:
    stats: TorchAllocatorStats
    received_at: float
    uuid: str | None = None  # as the report gave it
    poster: int | None = None  # the uid that posted it (None: not known, e.g. in tests)


def device_key(report: TorchReport) -> DeviceKey:
    """The report's GPU: its UUID when it sent one, else its index."""
    if report.device_uuid is not None:
        return ("uuid", gpu_uuid_key(report.device_uuid))
    return ("index", report.device_index)


class TorchReports:
    """Latest allocator figures per (pid, device), thread-safe, bounded, expiring."""

    def __init__(
        self,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self._clock = clock  # ages the entries
        self._wall_clock = wall_clock  # epoch seconds, as reported_at
        self._lock = threading.Lock()
        # pid -> device -> latest report (a process reports on few devices).
        self._entries: dict[int, dict[DeviceKey, _Entry]] = {}
        # poster uid -> its entries (pid, device), least recently received first.
        self._posters: dict[int | None, OrderedDict[tuple[int, DeviceKey], None]] = {}
        self._count = 0
        self.received_total = 0

    def record(self, report: TorchReport, *, poster_uid: int | None = None) -> None:
        """Keep ``report`` as its process's latest on its device. ``poster_uid``: who
        sent it, as the kernel says (its share of the store is bounded)."""
        stats = TorchAllocatorStats(
            allocated_bytes=report.allocated_bytes,
            reserved_bytes=report.reserved_bytes,
            reserved_unallocated_bytes=report.reserved_unallocated_bytes,
            peak_allocated_bytes=report.peak_allocated_bytes,
            reported_at=min(report.reported_at, self._wall_clock()),
        )
        now = self._clock()
        key = device_key(report)
        with self._lock:
            self.received_total += 1
            if key in self._entries.get(report.pid, {}):
                self._drop(report.pid, key)  # replaced: its place in the order too
            self._entries.setdefault(report.pid, {})[key] = _Entry(
                stats, now, report.device_uuid, poster_uid
            )
            self._posters.setdefault(poster_uid, OrderedDict())[(report.pid, key)] = None
            self._count += 1
            self._bound(poster_uid, now)

    def _bound(self, poster: int | None, now: float) -> None:
        # The caller holds the lock. Each eviction is the oldest of one poster's.
        if len(self._posters[poster]) > MAX_ENTRIES_PER_POSTER:
            self._drop(*next(iter(self._posters[poster])))
        if self._count > MAX_ENTRIES:
            self._expire(now)
            while self._count > MAX_ENTRIES:  # still full: the largest poster gives way
                largest = max(self._posters.values(), key=len)
                self._drop(*next(iter(largest)))

    def get(
        self,
        pid: int,
        device_index: int,
        *,
        start_time: float | None,
        uuids: tuple[str, ...] = (),
        host: Sequence[NamedDevice] = (),
    ) -> TorchAllocatorStats | None:
        """The latest fresh report for ``pid`` on the GPU NVML lists as ``device_index``
        with UUIDs ``uuids`` (the GPU's, and its MIG instances'), if any.

        ``host`` is every GPU and MIG instance of the host, against which a reported
        UUID is resolved (a prefix names a device only when no other device of the host
        shares it); empty: ``uuids`` alone.

        A report sent before the process started belongs to an earlier process that
        had the same PID, so it is ignored.
        """
        with self._lock:
            self._expire(self._clock())
            entry = self._find(pid, device_index, uuids, host)
        if entry is None:
            return None
        if start_time is not None and entry.stats.reported_at < start_time:
            return None
        return entry.stats

    def _find(
        self,
        pid: int,
        device_index: int,
        uuids: tuple[str, ...],
        host: Sequence[NamedDevice],
    ) -> _Entry | None:
        # The caller holds the lock. The newest of the matching reports wins (a
        # process may have sent both forms across an upgrade).
        mine = {gpu_uuid_key(u) for u in uuids}
        devices = host or [NamedDevice(u) for u in uuids]
        found = []
        for key, entry in self._entries.get(pid, {}).items():
            if key[0] == "index":
                hit = key[1] == device_index
            elif key[1] in mine:  # the same UUID: no other device can have it
                hit = True
            else:  # a prefix, or CUDA 11's MIG form
                named = None if entry.uuid is None else find_device(entry.uuid, devices)
                hit = named is not None and gpu_uuid_key(named.uuid) in mine
            if hit:
                found.append(entry)
        return max(found, key=lambda e: e.received_at, default=None)

    def _drop(self, pid: int, key: DeviceKey) -> None:
        mine = self._entries[pid]
        poster = mine.pop(key).poster
        self._count -= 1
        if not mine:
            del self._entries[pid]
        order = self._posters[poster]
        del order[(pid, key)]
        if not order:
            del self._posters[poster]

    def _expire(self, now: float) -> None:
        stale = [
            (pid, k)
            for pid, keys in self._entries.items()
            for k, e in keys.items()
            if now - e.received_at > STALE_AFTER_SECONDS
        ]
        for pid, key in stale:
            self._drop(pid, key)
