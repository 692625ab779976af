"""The event outbox: one row per change of an event, written in the event's transaction.

Whatever reacts to events (the alert engine) reads this table instead of polling
``events``: a row says which event changed, how (``opened``, ``closed``,
``updated`` when its kind or reason moved, or ``recorded`` for a point event), and when. Because the row is written in
the same transaction as the change, a committed change always has its row and a
rolled-back one never does; a retried snapshot that changes nothing writes nothing.

Consumers claim rows whose ``processed_at`` is null (on Postgres with
``FOR UPDATE SKIP LOCKED``, so replicas never take the same row) and set it when done.
They must not rely on ``id`` order across concurrent transactions: ids are drawn
before commit, so a lower id can become visible after a higher one.
"""

from __future__ import annotations

from functools import cache
from typing import Any, Literal, NamedTuple

from sqlalchemy import Connection, Double, ForeignKey, Index, Insert, String, Table, insert
from sqlalchemy.orm import Mapped, mapped_column

from gpuwatch.server.database.core import Base, IdType

# ``recorded``: a point event (gpu_back, reaped, oom), stored already closed.
Change = Literal["opened", "closed", "updated", "recorded"]


class OutboxRow(Base):
    """One change of one event. Times are Unix epoch seconds."""

    __tablename__ = "event_outbox"
    __table_args__ = (Index(None, "processed_at", "id"),)

    id: Mapped[int] = mapped_column(IdType, primary_key=True)
    event_id: Mapped[int] = mapped_column(ForeignKey("events.id", ondelete="CASCADE"), index=True)
    host_id: Mapped[int] = mapped_column(ForeignKey("hosts.id", ondelete="CASCADE"))
    change: Mapped[str] = mapped_column(String(16))
    kind: Mapped[str] = mapped_column(String(32))
    reason: Mapped[str] = mapped_column(String(64))
    # When the change happened in the event's own time (snapshot time for ingest).
    at: Mapped[float] = mapped_column(Double)
    processed_at: Mapped[float | None] = mapped_column(Double)


_TABLE: Table = OutboxRow.__table__  # type: ignore[assignment]


class PendingChange(NamedTuple):
    """A change waiting for its event's id (known once the event row is written)."""

    row: Any  # an EventRow (book.py): only its id is read, at write time
    change: Change
    kind: str
    reason: str
    at: float


def write_changes(connection: Connection, host_id: int, changes: list[PendingChange]) -> None:
    """Insert one outbox row per change (one executemany); call it in the transaction
    that wrote the events themselves, after their ids are known."""
    if not changes:
        return
    connection.execute(
        _insert_statement(),
        [
            {
                "event_id": pending.row.id,
                "host_id": host_id,
                "change": pending.change,
                "kind": pending.kind,
                "reason": pending.reason,
                "at": pending.at,
            }
            for pending in changes
        ],
    )


@cache
def _insert_statement() -> Insert:
    # Built once: a reused statement object skips SQLAlchemy's cache-key generation.
    return insert(_TABLE)
