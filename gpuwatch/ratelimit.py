"""The token bucket that the agent's and the server's rate limits share.

A bucket holds up to ``burst`` units and refills at ``per_second``; a request takes
units or is told how long to wait. The agent (OOM posts per local uid) and the server
(events and ingest work per host) keep their own maps of buckets; the arithmetic lives
here once.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TokenBucket:
    units: float
    at: float


def refill(bucket: TokenBucket, *, now: float, burst: float, per_second: float) -> None:
    """Refill ``bucket`` up to ``now``. A clock that steps back refills nothing (and
    takes nothing away), and the bucket keeps the later of the two times."""
    elapsed = max(0.0, now - bucket.at)
    bucket.units = min(burst, bucket.units + elapsed * per_second)
    bucket.at = max(bucket.at, now)
