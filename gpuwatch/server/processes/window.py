"""The idle and leak detectors' working set: a lifetime's recent coarse samples, packed.

Kept in ``process_windows.recent_window`` so a trend check reads one value per
lifetime instead of an hour of ``process_samples`` rows (reading those was most of the
cost of an ingest request). ``process_samples`` stays the history; this is a bounded
copy of its newest part, rewritten when a bucket closes.

Format: fixed-size little-endian records ``(t: f64, used_bytes: i64, peak_bytes: i64,
sm_ratio: f32)`` in increasing ``t``; ``-1`` bytes and a NaN ``sm_ratio`` stand for None. Fixed
size and order let :func:`append` trim and :func:`samples_since` slice by binary
search on the bytes, without decoding what they skip.
"""

from __future__ import annotations

import math
import struct
from functools import lru_cache

from gpuwatch.detectors import Sample

_RECORD = struct.Struct("<dqqf")
# Bound on one window whatever the settings: 1024 samples are 17 h at 60 s (28 KiB).
MAX_SAMPLES = 1024


def append(blob: bytes | None, sample: Sample, *, keep_after: float) -> bytes:
    """``blob`` without samples before ``keep_after`` (or at/after ``sample.t``, which a
    reopened lifetime can repeat), plus ``sample``, capped at :data:`MAX_SAMPLES`."""
    data = blob or b""
    start = _first_at_or_after(data, keep_after)
    end = _first_at_or_after(data, sample.t)
    start = max(start, end - (MAX_SAMPLES - 1))
    record = _RECORD.pack(
        sample.t,
        -1 if sample.used_bytes is None else sample.used_bytes,
        -1 if sample.peak_bytes is None else sample.peak_bytes,
        math.nan if sample.sm_ratio is None else sample.sm_ratio,
    )
    return data[start * _RECORD.size : end * _RECORD.size] + record


def samples_since(blob: bytes | None, since: float) -> list[Sample]:
    """The samples with ``t >= since``, oldest first."""
    if not blob:
        return []
    times, used, peak, sm = _columns(blob, _first_at_or_after(blob, since))
    if (used and min(min(used), min(peak)) < 0) or math.isnan(math.fsum(sm)):  # a None
        return [
            Sample(t, None if u < 0 else u, None if math.isnan(r) else r, None if p < 0 else p)
            for t, u, p, r in zip(times, used, peak, sm, strict=True)
        ]
    return list(map(Sample._make, zip(times, used, sm, peak, strict=True)))


def floor_since(blob: bytes | None, since: float) -> int | None:
    """The lowest known ``used_bytes`` among samples with ``t >= since`` (no decoding
    into :class:`Sample`; a cheap pre-check for the leak detector)."""
    if not blob:
        return None
    _, used, _, _ = _columns(blob, _first_at_or_after(blob, since))
    lowest = min(used, default=None)
    if lowest is None or lowest >= 0:
        return lowest
    return min((u for u in used if u >= 0), default=None)


def highest_floor_before(blob: bytes | None, before: float, *, since: float = 0.0) -> int | None:
    """The highest known ``used_bytes`` among samples with ``since <= t < before``: the
    most the holder held for a whole bucket before a detector's window (no decoding
    into :class:`Sample`)."""
    if not blob:
        return None
    start, end = _first_at_or_after(blob, since), _first_at_or_after(blob, before)
    if end <= start:
        return None
    used = _records(end - start).unpack_from(blob, start * _RECORD.size)[1::4]
    return max(used) if max(used) >= 0 else None


def _columns(
    blob: bytes, start: int
) -> tuple[tuple[float, ...], tuple[int, ...], tuple[int, ...], tuple[float, ...]]:
    """Times, lowest and highest memory, and SM ratios of the records from index
    ``start``, as stored.

    One ``unpack`` of all the records and four slices: a third of the cost of
    iterating record by record, and trend checks decode a window on most snapshots.
    """
    count = len(blob) // _RECORD.size - start
    flat = _records(count).unpack_from(blob, start * _RECORD.size)
    return flat[0::4], flat[1::4], flat[2::4], flat[3::4]


@lru_cache(maxsize=MAX_SAMPLES + 1)  # counts are bounded by MAX_SAMPLES
def _records(count: int) -> struct.Struct:
    return struct.Struct("<" + "dqqf" * count)


def _first_at_or_after(data: bytes, t: float) -> int:
    """Index of the first record with time >= ``t`` (bisection on the raw bytes)."""
    low, high = 0, len(data) // _RECORD.size
    while low < high:
        middle = (low + high) // 2
        if _RECORD.unpack_from(data, middle * _RECORD.size)[0] < t:
            low = middle + 1
        else:
            high = middle
    return low
