"""What one push, and one host over time, may make the ingest writer do.

A snapshot's cost on the server is its processes: each is a lifetime to reconcile,
and each new one is a row (plus its samples, windows and events). The schema allows
64 GPUs x 1,024 processes; a host within it held SQLite's one writer for 13-19 s
with one snapshot of 44,800 processes (a new start time each push, so 44,800 new
lifetimes), and every other host's push waited behind it. Real hosts have 8-16 GPUs
(MIG: up to 7 instances each) and a few hundred GPU processes, so three bounds a real
host never meets keep any one host's share of the writer small:

* **Per snapshot**: at most :data:`MAX_PROCESSES_PER_SNAPSHOT` processes are applied.
  Past it the server keeps each GPU's largest holders, an even share of the bound per
  GPU (:func:`bounded`); the rest are not tracked (logged). One snapshot then costs the
  writer about a second on SQLite at most.
* **Per push**: at most :data:`MAX_PROCESSES_PER_PUSH` processes are applied, summed
  over its snapshots. A push that accepts a partial answer has the snapshots past it
  answered ``deferred``; one that does not, and would need more, is refused 413 before
  anything is stored, and the agent splits it.
* **Per host, over time**: a bucket of work units (a snapshot costs one unit plus one
  per process applied) of :data:`HOST_WORK_BURST` units, refilled at
  :data:`HOST_WORK_PER_SECOND`. A push is taken up only while the host's bucket is not
  in debt; its first snapshot is always applied (so every push makes progress) and may
  leave the bucket in debt by at most one push's work; the push's further snapshots are
  ``deferred`` once the bucket is empty. A push that finds it in debt is answered 429
  with ``Retry-After``, nothing stored. A host of 1,000 processes polled every 5 s
  needs about 200 units a second, under the refill: an honest host keeps up (a real
  one needs a fifth of that), while one that pushes back to back, or lists 2,048 new
  processes each poll, gets about one push in 8 s. On SQLite such a push took 1.3 s
  (the audit's repro, trimmed to 2,048 processes): a sixth of the writer, where
  before one host took all of it.

Buckets live in this server process, like the event limits (auth/limits.py): N
replicas allow N times the rate.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable

from gpuwatch.ratelimit import TokenBucket
from gpuwatch.server.auth.limits import refilled
from gpuwatch.server.lru import BoundedLru
from gpuwatch.snapshot import GpuProcess, HostSnapshot

log = logging.getLogger(__name__)

# 16 GPUs x 128 processes, or 112 MIG instances x 18: several times a real host.
MAX_PROCESSES_PER_SNAPSHOT = 2048
# Four full snapshots, or a spool drain of 27 snapshots of a 300-process host.
MAX_PROCESSES_PER_PUSH = 8192
HOST_WORK_PER_SECOND = 250.0
HOST_WORK_BURST = 4.0 * MAX_PROCESSES_PER_PUSH
MAX_HOSTS = 16_384


def snapshot_work(snapshot: HostSnapshot) -> int:
    """Work units one snapshot costs: one, plus one per process it lists."""
    return 1 + sum(len(gpu.processes) for gpu in snapshot.gpus)


def bounded(
    snapshot: HostSnapshot, most: int = MAX_PROCESSES_PER_SNAPSHOT
) -> tuple[HostSnapshot, int]:
    """``snapshot`` with at most ``most`` processes, and how many were left out.

    Each GPU keeps its largest holders (by ``used_bytes``; unknown counts as least),
    up to a per-GPU share: the largest share at which all GPUs together keep at most
    ``most``, so a GPU with few processes keeps them all and the others split the rest.
    """
    counts = [len(gpu.processes) for gpu in snapshot.gpus]
    if sum(counts) <= most:
        return snapshot, 0
    share = _share(counts, most)
    gpus = []
    for gpu in snapshot.gpus:
        if len(gpu.processes) <= share:
            gpus.append(gpu)
            continue
        largest = sorted(range(len(gpu.processes)), key=lambda i: _holding(gpu.processes[i]))
        kept = sorted(largest[:share])  # in the agent's order
        gpus.append(gpu.model_copy(update={"processes": [gpu.processes[i] for i in kept]}))
    left_out = sum(counts) - sum(len(gpu.processes) for gpu in gpus)
    return snapshot.model_copy(update={"gpus": gpus}), left_out


def _holding(process: GpuProcess) -> tuple[int, int]:
    return (-(process.used_bytes if process.used_bytes is not None else -1), process.pid)


def _share(counts: list[int], most: int) -> int:
    """The largest per-GPU share ``k`` with ``sum(min(c, k)) <= most``."""
    low, high = 0, max(counts)
    while low < high:
        mid = (low + high + 1) // 2
        if sum(min(c, mid) for c in counts) <= most:
            low = mid
        else:
            high = mid - 1
    return low


class HostWork:
    """Work buckets per host id: ``burst`` units, refilled at ``per_second``, that may
    go into debt (a push's first snapshot is always applied).

    ``clock`` is monotonic seconds: a wall clock that steps would refill or drain
    buckets. Not the context's budget clock, which tests count the reads of.
    """

    def __init__(
        self,
        *,
        burst: float = HOST_WORK_BURST,
        per_second: float = HOST_WORK_PER_SECOND,
        max_hosts: int = MAX_HOSTS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if burst < 1 or per_second <= 0:
            raise ValueError("burst must be at least 1 and per_second positive")
        self.burst = burst
        self.per_second = per_second
        self._clock = clock
        self._buckets: BoundedLru[int, TokenBucket] = BoundedLru(max_hosts)
        self._lock = threading.Lock()

    def debt_seconds(self, host_id: int) -> float | None:
        """Seconds until the host's bucket is out of debt; None when it is not in debt."""
        with self._lock:
            units = self._refilled(host_id).units
        return None if units > 0 else max(1e-3, -units / self.per_second)

    def has_units(self, host_id: int) -> bool:
        with self._lock:
            return self._refilled(host_id).units > 0

    def charge(self, host_id: int, units: float) -> None:
        """Take ``units`` (work done), into debt if need be."""
        with self._lock:
            self._refilled(host_id).units -= units

    def _refilled(self, host_id: int) -> TokenBucket:
        return refilled(
            self._buckets,
            host_id,
            now=self._clock(),
            burst=self.burst,
            per_second=self.per_second,
        )


class PushWork:
    """What one push has applied, asked before each snapshot it applies.

    ``partial``: the push accepts ``deferred``; without it every snapshot is applied
    (the writer refused it before when it needed more than one push's work).
    """

    def __init__(self, meter: HostWork, host_id: int, *, partial: bool) -> None:
        self._meter = meter
        self._host_id = host_id
        self._partial = partial
        self.applied = 0  # snapshots
        self.units = 0

    def admit(self, snapshot: HostSnapshot) -> bool:
        """Whether to apply ``snapshot`` now (its work is then charged); False: defer it
        and the rest."""
        units = snapshot_work(snapshot)
        if self.applied and self._partial:
            if self.units + units > MAX_PROCESSES_PER_PUSH:
                return False
            if not self._meter.has_units(self._host_id):
                return False
        self.applied += 1
        self.units += units
        self._meter.charge(self._host_id, units)
        return True


def retry_after(seconds: float) -> str:
    """A ``Retry-After`` value for ``seconds`` of debt: whole seconds, at least one."""
    return str(max(1, math.ceil(seconds)))
