"""The two value types every detector speaks: a :class:`Sample` in, a :class:`Finding` out.

Detectors are pure functions over these and over the snapshot schema
(:mod:`gpuwatch.snapshot`); they read no clock, database or settings of their own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, NamedTuple

FindingKind = Literal["orphaned", "runaway", "idle", "filling_up"]
FindingReason = Literal[
    "dead_pid",
    "reparented",
    "jupyter_server_gone",
    "job_ended",
    "unattributed",
    "leak",
    "share",
    "idle",
    "filling_up",
]


class Sample(NamedTuple):
    """One observation of one process's (or one GPU's) memory and activity.

    ``t`` is Unix epoch seconds, ``used_bytes`` the memory held (bytes) and ``sm_ratio``
    the SM utilisation (0..1). When the sample stands for a span of polls (the server's
    downsampling buckets, :func:`gpuwatch.detectors.bucketize`), ``t`` is the span's
    start, ``used_bytes`` its *lowest* poll, ``peak_bytes`` its highest and ``sm_ratio``
    its busiest; for a single poll ``peak_bytes`` is ``None`` (the same as
    ``used_bytes``). ``None`` means "not known at that time", never zero: detectors treat
    it as missing evidence.

    A named tuple rather than a frozen dataclass: ingest builds an hour of these per
    trend check, and a frozen dataclass's ``__init__`` costs about three times as much.
    """

    t: float
    used_bytes: int | None
    sm_ratio: float | None
    peak_bytes: int | None = None


@dataclass(frozen=True)
class Finding:
    """Something wrong with a holder of GPU memory, with the evidence for it.

    ``kind`` is what the user is told (``orphaned``, ``runaway``, ``idle``, and for a
    whole GPU ``filling_up``); ``reason`` says which rule fired. ``summary`` is one
    sentence for a person. ``held_bytes`` is what the holder has now (``None`` when
    unknown). ``evidence`` holds the numbers the rule looked at, keyed by name with the
    unit in the name (``idle_seconds``).
    """

    kind: FindingKind
    reason: FindingReason
    summary: str
    held_bytes: int | None
    evidence: dict[str, object] = field(default_factory=dict)
