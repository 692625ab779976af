"""Events: conditions the server detected (or agents reported) about hosts, GPUs, processes.

A *condition* event (orphaned, runaway, idle, filling_up, gpu_lost, agent_silent) stays
open while the condition lasts: each snapshot that still shows it updates
``last_seen_at``, ``held_bytes``, ``summary`` and ``evidence`` of the one open row, and
the first that no longer shows it sets ``ended_at``. ``dedup_key`` names the condition within its host
(which detector, on which GPU or process lifetime), so it finds the open row.
*Point* events (gpu_back, reaped, oom) are stored closed: ``ended_at == started_at``.
The unique ``(host, dedup_key, started_at)`` makes a retried POST of the same point
event, or a racing insert of the same condition, a no-op.
"""

from __future__ import annotations

from typing import Any, get_args

from sqlalchemy import (
    JSON,
    BigInteger,
    Double,
    ForeignKey,
    Index,
    Integer,
    String,
    UniqueConstraint,
)
from sqlalchemy.orm import Mapped, mapped_column

from gpuwatch.server.database.core import Base, IdType
from gpuwatch.server.events.schemas import EventKind

# Every kind, in the order the docs list them (the API's EventKind is the one source).
EVENT_KINDS: tuple[str, ...] = get_args(EventKind)


class Event(Base):
    """One detected or reported event. Sizes bytes, times Unix epoch seconds."""

    __tablename__ = "events"
    __table_args__ = (
        UniqueConstraint("host_id", "dedup_key", "started_at"),
        # Ingest loads a host's open events; the API lists newest first.
        Index(None, "host_id", "ended_at"),
        Index(None, "started_at", "id"),
        Index(None, "kind", "started_at"),
        # Retention deletes by ``ended_at`` across hosts: without this, each of its
        # batches scanned the whole table under SQLite's write lock.
        Index(None, "ended_at"),
    )

    id: Mapped[int] = mapped_column(IdType, primary_key=True)
    kind: Mapped[str] = mapped_column(String(32))
    reason: Mapped[str] = mapped_column(String(64))
    host_id: Mapped[int] = mapped_column(ForeignKey("hosts.id", ondelete="CASCADE"))
    dedup_key: Mapped[str] = mapped_column(String(128))
    gpu_uuid: Mapped[str | None] = mapped_column(String(256))
    gpu_index: Mapped[int | None] = mapped_column(Integer)
    # Kept when retention deletes the lifetime: the event outlives its evidence rows.
    lifetime_id: Mapped[int | None] = mapped_column(
        ForeignKey("process_lifetimes.id", ondelete="SET NULL"), index=True
    )
    pid: Mapped[int | None] = mapped_column(Integer)
    user: Mapped[str | None] = mapped_column(String(256))
    held_bytes: Mapped[int | None] = mapped_column(BigInteger)
    summary: Mapped[str] = mapped_column(String(1024))
    evidence: Mapped[dict[str, Any]] = mapped_column(JSON)
    started_at: Mapped[float] = mapped_column(Double)
    last_seen_at: Mapped[float] = mapped_column(Double)
    ended_at: Mapped[float | None] = mapped_column(Double)
