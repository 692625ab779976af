"""Process lifetimes (one row per process per GPU it holds memory on) and their samples.

A lifetime's identity is ``(host, gpu, pid, start_time)``: the process start time tells
a reused PID from the process that had it before, and a process with contexts on two
GPUs has two lifetimes, because memory, idleness and orphan-holding are per GPU.
``start_time`` is NULL when the agent cannot see the process (another PID namespace);
such lifetimes are matched by PID alone. A process that disappears and comes back with
the same identity (one missed poll) reopens its lifetime instead of starting another.

Sizes are bytes, times Unix epoch seconds (agent clock), ratios 0..1.
"""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Boolean,
    Double,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    String,
    UniqueConstraint,
)
from sqlalchemy.orm import Mapped, mapped_column

from gpuwatch.server.database.core import Base, IdType, rewritten_in_place

SHORT = 256
LONG = 4096


class ProcessLifetime(Base):
    """What one process held on one GPU, from first to last observation.

    ``ended_at`` is the ``collected_at`` of the first snapshot that no longer listed it
    (or its last observation, when its host went silent or rebooted); NULL while open.
    ``idle_since`` is when its run of polls with zero SM activity began (NULL when it is
    active or its activity is unknown). ``bucket_*`` accumulate the current
    downsampling interval, written to ``process_samples`` when the next one starts.
    Ingest reads and writes every column of an open lifetime on every snapshot, so the
    row stays small: its recent samples live in :class:`ProcessWindow`.
    """

    __tablename__ = "process_lifetimes"
    __table_args__ = (
        UniqueConstraint("host_id", "gpu_id", "pid", "start_time"),
        # Ingest loads a host's open lifetimes on every snapshot.
        Index(None, "host_id", "ended_at"),
        # History: "what was on this GPU at T".
        Index(None, "gpu_id", "first_seen_at"),
        Index(None, "user", "first_seen_at"),
        # Retention deletes by ``ended_at`` across hosts: without this, each of its
        # batches scanned the whole table under SQLite's write lock.
        Index(None, "ended_at"),
        rewritten_in_place("process_lifetimes"),
    )

    id: Mapped[int] = mapped_column(IdType, primary_key=True)
    host_id: Mapped[int] = mapped_column(ForeignKey("hosts.id", ondelete="CASCADE"))
    gpu_id: Mapped[int] = mapped_column(ForeignKey("gpus.id", ondelete="CASCADE"))
    pid: Mapped[int] = mapped_column(Integer)
    start_time: Mapped[float | None] = mapped_column(Double)
    kind: Mapped[str] = mapped_column(String(16))
    name: Mapped[str | None] = mapped_column(String(SHORT))
    command: Mapped[str | None] = mapped_column(String(LONG))
    user: Mapped[str | None] = mapped_column(String(SHORT))
    # A Linux uid is a uint32, past Postgres INTEGER. SQLite's INTEGER holds 64 bits
    # already, and declaring it BIGINT there would rebuild the table (and cascade).
    uid: Mapped[int | None] = mapped_column(BigInteger().with_variant(Integer(), "sqlite"))
    container_id: Mapped[str | None] = mapped_column(String(SHORT))
    pod_uid: Mapped[str | None] = mapped_column(String(SHORT))
    slurm_job_id: Mapped[str | None] = mapped_column(String(SHORT))
    orphaned: Mapped[bool] = mapped_column(Boolean, default=False)
    first_seen_at: Mapped[float] = mapped_column(Double)
    last_seen_at: Mapped[float] = mapped_column(Double)
    ended_at: Mapped[float | None] = mapped_column(Double)
    current_bytes: Mapped[int | None] = mapped_column(BigInteger)
    peak_bytes: Mapped[int | None] = mapped_column(BigInteger)
    sm_ratio: Mapped[float | None] = mapped_column(Double)
    idle_since: Mapped[float | None] = mapped_column(Double)
    bucket_start_at: Mapped[float | None] = mapped_column(Double)
    bucket_min_bytes: Mapped[int | None] = mapped_column(BigInteger)
    bucket_max_bytes: Mapped[int | None] = mapped_column(BigInteger)
    bucket_max_sm_ratio: Mapped[float | None] = mapped_column(Double)


class ProcessWindow(Base):
    """A lifetime's recent coarse samples, packed (processes/window.py): what the idle
    and leak detectors read, one value per lifetime, when one of its buckets closes.

    A table of its own rather than a column of ``process_lifetimes``: SQLite and
    Postgres both rewrite a whole row to update it, and ingest updates every open
    lifetime on every snapshot, so an inline kilobyte of samples multiplied the bytes
    each of those updates (and the commit) wrote. A window changes only once per
    ``sample_interval_seconds``. The row appears when the lifetime's first bucket closes
    and goes with the lifetime.
    """

    __tablename__ = "process_windows"
    __table_args__ = rewritten_in_place("process_windows")

    lifetime_id: Mapped[int] = mapped_column(
        ForeignKey("process_lifetimes.id", ondelete="CASCADE"), primary_key=True
    )
    recent_window: Mapped[bytes] = mapped_column(LargeBinary)


class ProcessSample(Base):
    """Coarse per-process trend: one row per lifetime per ``sample_interval_seconds``.

    ``t`` is the bucket start. ``used_bytes`` is the bucket's *floor* (lowest poll) and
    ``peak_bytes`` its highest; ``sm_ratio`` is the bucket's highest SM activity, so a
    single busy poll keeps the bucket from counting as idle. These rows are also the
    recent window the idle and leak detectors read.
    """

    __tablename__ = "process_samples"

    lifetime_id: Mapped[int] = mapped_column(
        ForeignKey("process_lifetimes.id", ondelete="CASCADE"), primary_key=True
    )
    t: Mapped[float] = mapped_column(Double, primary_key=True, index=True)
    used_bytes: Mapped[int | None] = mapped_column(BigInteger)
    peak_bytes: Mapped[int | None] = mapped_column(BigInteger)
    sm_ratio: Mapped[float | None] = mapped_column(Double)
