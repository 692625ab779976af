"""The server's downsampling rule as a pure function: raw polls in, one sample per bucket out.

Ingest (``gpuwatch/server/ingest/apply.py``, ``_observe``) keeps one accumulating bucket
per process and writes it out when a poll falls into a later bucket; the trend detectors
only ever see those bucket samples. Tests, benches and offline replays use
:func:`bucketize` to feed the detectors exactly what the server would.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from itertools import pairwise

from gpuwatch.detectors.types import Sample


def bucket_start(t: float, interval_seconds: float) -> float:
    """Start (epoch s) of the bucket ``[k * interval, (k + 1) * interval)`` holding ``t``.

    The same float expression as the server's, so both agree on every edge.
    """
    return math.floor(t / interval_seconds) * interval_seconds


def bucket_width(times: Iterable[float]) -> float:
    """The narrowest step between consecutive ``times`` (oldest first): one bucket, for
    the server's bucket samples (a missing bucket only widens a step), one poll
    interval for raw polls; 0.0 for fewer than two distinct times."""
    return min((b - a for a, b in pairwise(times) if b > a), default=0.0)


class _Bucket:
    """One bucket being filled: lowest and highest known bytes, busiest SM, any unknown SM."""

    __slots__ = ("busiest", "high", "low", "unknown_sm")

    def __init__(self) -> None:
        self.low: int | None = None
        self.high: int | None = None
        self.busiest = 0.0
        self.unknown_sm = False

    def add(self, sample: Sample) -> None:
        used = sample.used_bytes
        high = used if sample.peak_bytes is None else sample.peak_bytes
        if used is not None and (self.low is None or used < self.low):
            self.low = used
        if high is not None and (self.high is None or high > self.high):
            self.high = high
        if sample.sm_ratio is None:
            self.unknown_sm = True
        elif sample.sm_ratio > self.busiest:
            self.busiest = sample.sm_ratio

    def sample(self, start: float) -> Sample:
        # Any activity wins; otherwise one unknown poll makes the bucket unknown
        # (apply.py, ``_busiest``): idleness must be observed in every poll of it.
        sm = self.busiest if self.busiest > 0 else None if self.unknown_sm else 0.0
        return Sample(start, self.low, sm, self.high)


def bucketize(
    samples: Iterable[Sample], interval_seconds: float, *, now: float | None = None
) -> list[Sample]:
    """Downsample polls into one :class:`Sample` per bucket of ``interval_seconds``, oldest first.

    Each bucket is stamped with its start ``t`` (epoch s); ``used_bytes`` is its lowest
    known poll, ``peak_bytes`` its highest (a poll's own ``peak_bytes`` counts when it
    has one, so buckets can be re-bucketed), and ``sm_ratio`` its busiest: any activity
    wins, otherwise one unknown poll makes the bucket unknown, and only polls all
    observed at zero make it idle. ``None`` never counts as 0. Buckets without polls
    are absent.

    With ``now``, only complete buckets are returned: the one containing ``now`` is
    still open (the server has not written it yet), and polls after ``now`` are ignored.
    Without it, the last bucket is returned as it stands (as when a lifetime ends).
    Cost: O(n) for polls in time order (O(n log n) otherwise, for the final sort).
    """
    if not interval_seconds > 0:
        raise ValueError(f"interval_seconds must be positive, not {interval_seconds!r}")
    open_start = math.inf if now is None else bucket_start(now, interval_seconds)
    buckets: dict[float, _Bucket] = {}
    for sample in samples:
        start = bucket_start(sample.t, interval_seconds)
        if start >= open_start:
            continue
        bucket = buckets.get(start)
        if bucket is None:
            bucket = buckets[start] = _Bucket()
        bucket.add(sample)
    return [bucket.sample(start) for start, bucket in sorted(buckets.items())]
