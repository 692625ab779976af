"""Ingest of snapshot batches: idempotency, then state, samples and events, in one transaction.

What "accepted" promises: the snapshot's key is committed in ``snapshots_seen`` in
the same transaction as everything derived from it, so a crash either keeps both or
neither, and the agent's retry after a lost reply is answered ``duplicate``. Keys are
per host (the token's), so no other host's token can claim them.

Snapshots are applied oldest first, each at its *effective time*: its ``collected_at``,
but never later than the server's clock on arrival. An agent clock running ahead
therefore cannot stamp the host's state with a future time that every correct
snapshot after it would look older than. One not newer than the host's newest applied
snapshot (a late spool drain) is recorded as seen but does not move the host's current
state backwards: it is answered ``late``, not ``accepted``, so a snapshot is never
answered as applied when it was not.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from functools import cache

from sqlalchemy import Table
from sqlalchemy.orm import Session
from sqlalchemy.sql.dml import ReturningInsert

from gpuwatch.errors import GpuwatchError
from gpuwatch.server.database.dialects import insert_ignoring_conflicts
from gpuwatch.server.events.book import SILENT_KEY
from gpuwatch.server.ingest.apply import apply_snapshot
from gpuwatch.server.ingest.cache import HostStateCache, KeptState
from gpuwatch.server.ingest.models import SnapshotSeen
from gpuwatch.server.ingest.state import HostState
from gpuwatch.settings import ServerSettings
from gpuwatch.snapshot import HostSnapshot
from gpuwatch.wire import IngestRequest, ItemResult

log = logging.getLogger(__name__)

# Agent clocks run ahead by seconds, not by this much. A snapshot further in the
# future would pin the host's "newest applied" time and make every honest snapshot
# after it look late, so it is refused (422) until the agent's clock is fixed.
MAX_FUTURE_SKEW_SECONDS = 600.0

_SEEN: Table = SnapshotSeen.__table__  # type: ignore[assignment]


class SnapshotRejected(GpuwatchError):
    """A well-formed snapshot the server will not store (answered 422); ``index`` is its
    place in the request."""

    def __init__(self, message: str, *, index: int) -> None:
        super().__init__(message)
        self.index = index


@dataclass(frozen=True)
class IngestResult:
    """Per-item outcome (in request order) and the events this request opened."""

    results: list[ItemResult]
    opened: Counter[str] = field(default_factory=Counter)
    # The host's state as this request wrote it: for the cache, once committed.
    kept: KeptState | None = None

    @property
    def accepted(self) -> int:
        """Snapshots this request stored: applied (``accepted``) or ``late``."""
        return len(self.results) - self.duplicate

    @property
    def late(self) -> int:
        return self.results.count("late")

    @property
    def duplicate(self) -> int:
        return self.results.count("duplicate")


def ingest_snapshots(
    *,
    session: Session,
    dialect: str,
    host_id: int,
    request: IngestRequest,
    settings: ServerSettings,
    now: float,
    cache: HostStateCache | None = None,
) -> IngestResult:
    """Store a batch of one host's snapshots; the caller commits, and then may keep
    ``result.kept`` in ``cache`` (the host's state is taken from it when current).

    ``now`` is the server's clock (epoch seconds). Raises :class:`SnapshotRejected`
    for a snapshot from too far in the future; nothing is written then.
    """
    for index, snapshot in enumerate(request.snapshots):
        if snapshot.collected_at > now + MAX_FUTURE_SKEW_SECONDS:
            raise SnapshotRejected(
                f"snapshot {snapshot.sequence} was collected {snapshot.collected_at - now:.0f} s"
                " in the future; fix the agent's clock",
                index=index,
            )
    # Lock the host first: on Postgres this queues a concurrent request of the same
    # host here, before it can insert its keys.
    state = HostState.load(session=session, dialect=dialect, host_id=host_id, cache=cache)
    fresh = _record_seen(session, dialect, host_id, request.snapshots, now)
    results: list[ItemResult] = []
    to_apply: list[tuple[float, int, int]] = []  # (effective time, sequence, index)
    for index, snapshot in enumerate(request.snapshots):
        if snapshot.idempotency_key in fresh:
            fresh.discard(snapshot.idempotency_key)  # a repeat within the batch is a duplicate
            results.append("accepted")
            to_apply.append((min(snapshot.collected_at, now), snapshot.sequence, index))
        else:
            results.append("duplicate")
    for at, _, index in sorted(to_apply):
        newest = state.host.last_seen_at
        if newest is not None and at <= newest:
            results[index] = "late"
            continue
        apply_snapshot(state, request.snapshots[index], settings=settings, at=at)
    late = results.count("late")
    if late:
        log.info("host %s: %d late snapshot(s) recorded without replay", state.host.hostname, late)
    state.host.last_received_at = now
    if request.spool_dropped_total is not None:
        state.host.spool_dropped_total = request.spool_dropped_total
    state.events.clear(SILENT_KEY, at=now)
    state.flush()
    return IngestResult(results=results, opened=state.events.opened, kept=state.kept())


def _record_seen(
    session: Session,
    dialect: str,
    host_id: int,
    snapshots: list[HostSnapshot],
    now: float,
) -> set[tuple[str, str, int]]:
    """Insert the batch's keys; return those that were new (one round trip)."""
    rows = {
        s.idempotency_key: {
            "agent_id": s.agent_id,
            "boot_id": s.boot_id,
            "sequence": s.sequence,
            "host_id": host_id,
            "collected_at": s.collected_at,
            "received_at": now,
        }
        for s in reversed(snapshots)  # the first occurrence of a key wins
    }
    inserted = session.connection().execute(_insert_seen(dialect), list(rows.values()))
    return {(agent_id, boot_id, sequence) for agent_id, boot_id, sequence in inserted}


@cache
def _insert_seen(dialect: str) -> ReturningInsert[str, str, int]:
    # Built once per dialect: a reused statement object skips SQLAlchemy's cache-key
    # generation, on every ingest request.
    return insert_ignoring_conflicts(_SEEN, dialect).returning(
        _SEEN.c.agent_id, _SEEN.c.boot_id, _SEEN.c.sequence
    )
