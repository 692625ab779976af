"""Per-host rate limits on what an agent token may write besides snapshots.

A token bucket per host (keyed by the token's host, never by anything in the body): a
request takes units, the bucket refills at a steady rate up to its burst, and a request
that finds too few is answered 429 with ``Retry-After``. Reported events cost one unit
plus one per :data:`EVENT_UNIT_BYTES` of body, so a host that sends large evidence gets
fewer events, and the bytes one host can make the server store are bounded: at most
``EVENT_PER_SECOND * EVENT_UNIT_BYTES`` (3.2 KiB/s, about 280 MiB a day) sustained.

Buckets live in this server process: N replicas allow N times the rate. Forgotten
hosts (least recently used, past :data:`MAX_HOSTS`) start again with a full bucket.
"""

from __future__ import annotations

import math
import threading

from gpuwatch.ratelimit import TokenBucket, refill
from gpuwatch.server.lru import BoundedLru

# An OOM's event is about 30-60 KiB (the diagnosis and the host's snapshot): 2-4 units.
# A burst of 60 units takes 15-30 OOMs at once (every rank of a job); after that, one
# unit every 5 s.
EVENT_BURST = 60.0
EVENT_PER_SECOND = 0.2
EVENT_UNIT_BYTES = 16 * 2**10
MAX_HOSTS = 16_384


def event_cost(body_bytes: int) -> float:
    """Units one reported event of ``body_bytes`` takes."""
    return 1.0 + body_bytes // EVENT_UNIT_BYTES


def refilled(
    buckets: BoundedLru[int, TokenBucket],
    host_id: int,
    *,
    now: float,
    burst: float,
    per_second: float,
) -> TokenBucket:
    """``host_id``'s bucket (a full one the first time), refilled up to ``now``; the
    caller holds the lock that guards ``buckets``."""
    bucket = buckets.get(host_id)
    if bucket is None:
        bucket = TokenBucket(units=burst, at=now)
        buckets.put(host_id, bucket)
    refill(bucket, now=now, burst=burst, per_second=per_second)
    return bucket


class HostRateLimiter:
    """Token buckets per host id: ``burst`` units, refilled at ``per_second``."""

    def __init__(
        self,
        *,
        burst: float = EVENT_BURST,
        per_second: float = EVENT_PER_SECOND,
        max_hosts: int = MAX_HOSTS,
    ) -> None:
        if burst < 1 or per_second <= 0:
            raise ValueError("burst must be at least 1 and per_second positive")
        self.burst = burst
        self.per_second = per_second
        self._buckets: BoundedLru[int, TokenBucket] = BoundedLru(max_hosts)
        self._lock = threading.Lock()

    def take(self, host_id: int, *, now: float, cost: float = 1.0) -> float | None:
        """Take ``cost`` units of the host's bucket at ``now`` (epoch seconds).

        Returns None when they were there (and are now taken), else the seconds until
        they will be (nothing is taken). A cost above the burst is capped at the burst,
        so every request can pass once the bucket is full.
        """
        return self._ask(host_id, now=now, cost=cost, taking=True)

    def wait(self, host_id: int, *, now: float, cost: float = 1.0) -> float | None:
        """:meth:`take`, taking nothing: whether ``cost`` units are there now."""
        return self._ask(host_id, now=now, cost=cost, taking=False)

    def _ask(self, host_id: int, *, now: float, cost: float, taking: bool) -> float | None:
        cost = min(cost, self.burst)
        with self._lock:
            bucket = refilled(
                self._buckets, host_id, now=now, burst=self.burst, per_second=self.per_second
            )
            if bucket.units >= cost:
                if taking:
                    bucket.units -= cost
                return None
            return (cost - bucket.units) / self.per_second


def retry_after_header(seconds: float) -> dict[str, str]:
    """``Retry-After`` in whole seconds, rounded up (RFC 9110 §10.2.3)."""
    return {"Retry-After": str(max(1, math.ceil(seconds)))}
