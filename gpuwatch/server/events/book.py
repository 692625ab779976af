"""The open condition events of one host, reconciled in memory and written back in bulk.

Ingest loads a host's open events once per request, tells the book what each detector
concluded for each snapshot (:meth:`EventBook.observe` when a condition holds,
:meth:`EventBook.clear` when it was evaluated and no longer holds), then writes the
result with one INSERT and one UPDATE executemany (:meth:`EventBook.flush`). A
condition that continues over a thousand snapshots is one row, updated.

This is the one path that writes events: ingest, the scheduled jobs (``agent_silent``)
and reported events all go through a book, and :meth:`EventBook.flush` writes one
outbox row per change (server/events/outbox.py) in the same transaction. A change is
an event opened, closed, or moved to another kind or reason; refreshing the evidence
of an open event is not a change.

Keys name the *slot* a condition comes from, not the finding: the orphan detector can
move from ``reparented`` to ``dead_pid`` for the same process and that stays one
``orphaned`` event whose reason is updated. Slots:

* ``<slot>:lt<lifetime id>`` per process: ``orphan``, ``runaway`` (share or leak) and
  ``idle``, one per event kind,
* ``<slot>:gpu<gpu id>`` per GPU: unattributed, filling_up, gpu_lost, gpu_back,
* ``agent_silent`` for the host.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from functools import cache
from typing import Any

from sqlalchemy import Select, Table, Update, bindparam, insert, select, update
from sqlalchemy.orm import Session
from sqlalchemy.sql.dml import ReturningInsert

from gpuwatch.server.database.bulk import BulkStatement
from gpuwatch.server.database.dialects import unnest_update
from gpuwatch.server.events.models import Event
from gpuwatch.server.events.outbox import Change, PendingChange, write_changes

_TABLE: Table = Event.__table__  # type: ignore[assignment]
_MUTABLE = ("kind", "reason", "held_bytes", "summary", "evidence", "last_seen_at", "ended_at")
# What load reads: EventRow's fields up to ended_at, in order.
_LOADED = (
    "id",
    "dedup_key",
    "kind",
    "reason",
    "held_bytes",
    "summary",
    "evidence",
    "started_at",
    "last_seen_at",
    "ended_at",
)
_MAX_SUMMARY = 1024
# The slot of a host's agent_silent event (ingest closes it, the scheduled job opens it).
SILENT_KEY = "agent_silent"


@dataclass(frozen=True)
class Condition:
    """What a detector (or the server) observed, and about whom."""

    kind: str
    reason: str
    summary: str
    held_bytes: int | None = None
    evidence: dict[str, Any] = field(default_factory=dict)
    gpu_uuid: str | None = None
    gpu_index: int | None = None
    lifetime_id: int | None = None
    pid: int | None = None
    user: str | None = None


@dataclass(eq=False)
class EventRow:
    """An event as ingest holds it (``dirty``: changed since it was last written)."""

    id: int | None
    dedup_key: str
    kind: str
    reason: str
    held_bytes: int | None
    summary: str
    evidence: dict[str, Any]
    started_at: float
    last_seen_at: float
    ended_at: float | None
    gpu_uuid: str | None = None
    gpu_index: int | None = None
    lifetime_id: int | None = None
    pid: int | None = None
    user: str | None = None
    dirty: bool = False


class EventBook:
    """Open events of one host keyed by slot; new and changed rows are kept for flush."""

    def __init__(self, host_id: int, rows: list[EventRow]) -> None:
        self.host_id = host_id
        self._open: dict[str, EventRow] = {row.dedup_key: row for row in rows}
        self._pending: list[EventRow] = []  # rows to write: new, changed or closed
        self._changes: list[PendingChange] = []  # outbox rows to write with them
        self.opened: Counter[str] = Counter()

    @classmethod
    def load(cls, *, session: Session, host_id: int) -> EventBook:
        """Read the open events of ``host_id``."""
        # Core statements on the connection: ingest runs this on every request, and
        # the ORM's execution path cost more than the query (see _open_query).
        rows = session.connection().execute(_open_query(), {"host_id": host_id})
        return cls(host_id, [EventRow(*row) for row in rows])

    def open_rows(self) -> list[EventRow]:
        """The open events, as :meth:`flush` left them (each with its id): what a
        later request may start from instead of :meth:`load`."""
        return list(self._open.values())

    def is_open(self, key: str) -> bool:
        return key in self._open

    def open_reason(self, key: str) -> str | None:
        """The reason of the open event in slot ``key`` (None when none is open)."""
        row = self._open.get(key)
        return None if row is None else row.reason

    def open_keys(self, prefix: str) -> list[str]:
        """Keys of open events whose slot starts with ``prefix``."""
        return [key for key in self._open if key.startswith(prefix)]

    def observe(self, key: str, condition: Condition, *, at: float) -> None:
        """The condition holds at ``at``: open its event, or refresh the open one."""
        row = self._open.get(key)
        if row is None:
            row = EventRow(
                id=None,
                dedup_key=key,
                kind=condition.kind,
                reason=condition.reason,
                held_bytes=condition.held_bytes,
                summary=condition.summary[:_MAX_SUMMARY],
                evidence=condition.evidence,
                started_at=at,
                last_seen_at=at,
                ended_at=None,
                gpu_uuid=condition.gpu_uuid,
                gpu_index=condition.gpu_index,
                lifetime_id=condition.lifetime_id,
                pid=condition.pid,
                user=condition.user,
            )
            self._open[key] = row
            self._pending.append(row)
            self.opened[condition.kind] += 1
            self._change(row, "opened", at)
            return
        if at < row.last_seen_at:
            return
        if (row.kind, row.reason) != (condition.kind, condition.reason):
            row.kind, row.reason = condition.kind, condition.reason
            self._change(row, "updated", at)
        row.held_bytes, row.evidence = condition.held_bytes, condition.evidence
        row.summary = condition.summary[:_MAX_SUMMARY]
        row.last_seen_at = at
        self._mark(row)

    def clear(self, key: str, *, at: float) -> bool:
        """The condition was evaluated at ``at`` and no longer holds: close its event.

        Returns whether an open event was closed.
        """
        row = self._open.pop(key, None)
        if row is None:
            return False
        row.ended_at = max(at, row.last_seen_at)
        self._mark(row)
        self._change(row, "closed", row.ended_at)
        return True

    def record_point(self, key: str, condition: Condition, *, at: float) -> None:
        """A point event (e.g. ``gpu_back``): stored closed, ``ended_at == started_at``,
        with one ``recorded`` change."""
        # Unique by (host, key, started_at), so a replay of the same point is one row.
        self.observe(key, condition, at=at)
        self.clear(key, at=at)
        row = self._changes[-1].row
        del self._changes[-2:]
        self._change(row, "recorded", at)

    def flush(self, *, session: Session) -> None:
        """Write new events (one INSERT) and changed ones (one UPDATE executemany).

        A book serves one request: call this once, at its end. Afterwards every row
        has its id and is clean, so :meth:`open_rows` can seed the next request's book.
        """
        new = [row for row in self._pending if row.id is None]
        changed = [row for row in self._pending if row.id is not None]
        connection = session.connection()
        if new:
            ids = connection.execute(
                _insert_statement(),
                [
                    {
                        "host_id": self.host_id,
                        "dedup_key": row.dedup_key,
                        "started_at": row.started_at,
                        "gpu_uuid": row.gpu_uuid,
                        "gpu_index": row.gpu_index,
                        "lifetime_id": row.lifetime_id,
                        "pid": row.pid,
                        "user": row.user,
                        **{name: getattr(row, name) for name in _MUTABLE},
                    }
                    for row in new
                ],
            ).scalars()
            for row, row_id in zip(new, ids, strict=True):
                row.id = row_id
        if changed:
            _UPDATE.execute(connection, [_update_row(row) for row in changed])
        write_changes(connection, self.host_id, self._changes)
        for row in self._pending:
            row.dirty = False
        self._pending.clear()
        self._changes.clear()

    def _change(self, row: EventRow, change: Change, at: float) -> None:
        self._changes.append(PendingChange(row, change, row.kind, row.reason, at))

    def _mark(self, row: EventRow) -> None:
        if not row.dirty and row.id is not None:
            self._pending.append(row)
        row.dirty = True


# Built once: a reused statement object skips SQLAlchemy's cache-key generation. Plain
# Core (not the driver-level BulkStatement): evidence is JSON, which needs the
# dialect's type processing.
@cache
def _open_query() -> Select[Any]:
    return select(*(_TABLE.c[name] for name in _LOADED)).where(
        _TABLE.c.host_id == bindparam("host_id"), _TABLE.c.ended_at.is_(None)
    )


@cache
def _insert_statement() -> ReturningInsert[Any]:
    return insert(_TABLE).returning(_TABLE.c.id, sort_by_parameter_order=True)


def _update_row(row: EventRow) -> tuple[Any, ...]:
    """``row``'s values for :data:`_UPDATE`: its id, then :data:`_MUTABLE`."""
    values = {name: getattr(row, name) for name in _MUTABLE}
    values["evidence"] = json.dumps(row.evidence)
    return (row.id, *values.values())


def _update_statement() -> Update:
    return (
        update(_TABLE)
        .where(_TABLE.c.id == bindparam("row_id"))
        .values({name: bindparam(name) for name in _MUTABLE})
    )


# Every open event of a pushing host is refreshed on every push, so this runs once a
# push: at driver level (BulkStatement), as ingest's other per-push statements, rather
# than through Core's executemany. On Postgres the events' flush went from 17 % to 14 %
# of the ingest writer's samples (py-spy, 150 hosts; most of the rest is the round
# trip). The evidence goes as the JSON text SQLAlchemy's JSON type would have written.
_UPDATE = BulkStatement(
    _update_statement,
    ("row_id", *_MUTABLE),
    postgres=lambda: unnest_update(_TABLE, ("row_id", *_MUTABLE), key="id", param="row_id"),
)
