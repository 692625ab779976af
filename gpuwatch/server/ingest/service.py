"""Ingest of snapshot batches: idempotency, then state, samples and events, in one transaction.

What "accepted" promises: the snapshot's key is committed in ``snapshots_seen`` in
the same transaction as everything derived from it, so a crash either keeps both or
neither, and the agent's retry after a lost reply is answered ``duplicate``. Keys are
per host (the token's), so no other host's token can claim them. A key stored with
another ``collected_at`` is not a retry but a new snapshot under a reused key (an agent
whose memory a VM restore took back): it is stored and applied (:func:`_reused_keys`).

Snapshots are applied oldest first, each at its *effective time*: its ``collected_at``,
but never later than the server's clock on arrival. An agent clock running ahead
therefore cannot stamp the host's state with a future time that every correct
snapshot after it would look older than. One not newer than the host's newest applied
snapshot (a late spool drain) is recorded as seen but does not move the host's current
state backwards: it is answered ``late``, not ``accepted``, so a snapshot is never
answered as applied when it was not.

A request may have a time budget (``out_of_time``, from ingest/views.py). Once it is
spent, after at least one snapshot is done, the snapshots still to apply are answered
``deferred``: their keys are taken back out of ``snapshots_seen``, and what was done is
committed exactly as if the agent had sent only those (the ones that apply first, so
for a batch sent oldest first, a prefix). Always doing one keeps every request making
progress, however late it got its turn.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache

from sqlalchemy import Delete, Table, Update, bindparam, delete, select, tuple_, update
from sqlalchemy.orm import Session
from sqlalchemy.sql.dml import ReturningInsert

from gpuwatch import wire
from gpuwatch.errors import GpuwatchError
from gpuwatch.server.database.dialects import insert_ignoring_conflicts
from gpuwatch.server.events.book import SILENT_KEY
from gpuwatch.server.ingest.apply import apply_snapshot
from gpuwatch.server.ingest.cache import HostStateCache, KeptState
from gpuwatch.server.ingest.models import SnapshotSeen
from gpuwatch.server.ingest.state import HostState
from gpuwatch.server.ingest.work import PushWork
from gpuwatch.settings import ServerSettings
from gpuwatch.snapshot import HostSnapshot
from gpuwatch.wire import IngestRequest, ItemResult

log = logging.getLogger(__name__)

# Agent clocks run ahead by seconds, not by this much. A snapshot further in the
# future would pin the host's "newest applied" time and make every honest snapshot
# after it look late, so it is refused (422 clock_skew). The server cannot tell that
# from its own clock running behind: the answer says both, the agent keeps a snapshot
# its own clock does not put in the future (gpuwatch/agent/reporter.py), and the
# writer suspects this server's clock when many hosts look ahead (ServerStats).
MAX_FUTURE_SKEW_SECONDS = wire.MAX_FUTURE_SKEW_SECONDS

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
    # Snapshots applied at the server's receive time: their agent's clock stepped back.
    clock_stepped: int = 0
    # The host's state as this request wrote it: for the cache, once committed.
    kept: KeptState | None = None

    @property
    def accepted(self) -> int:
        """Snapshots this request stored: applied (``accepted``) or ``late``."""
        return len(self.results) - self.duplicate - self.deferred

    @property
    def deferred(self) -> int:
        """Snapshots not stored because the request's time budget ran out."""
        return self.results.count("deferred")

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
    out_of_time: Callable[[], bool] | None = None,
    push_interval: float | None = None,
    work: PushWork | None = None,
) -> IngestResult:
    """Store a batch of one host's snapshots; the caller commits, and then may keep
    ``result.kept`` in ``cache`` (the host's state is taken from it when current).

    ``now`` is the server's clock (epoch seconds). Raises :class:`SnapshotRejected`
    for a snapshot from too far in the future; nothing is written then.
    ``out_of_time``, when given, is asked before each snapshot after the first; once
    it answers true the rest are ``deferred`` (see the module docstring). Without it
    the whole batch is stored. ``push_interval`` is the one the agent reported, kept as
    the host's (its silence is counted in it); None keeps what the host had.
    ``work``, when given, is asked before each snapshot is applied (ingest/work.py);
    once it refuses one, it and the rest are ``deferred``.
    """
    for index, snapshot in enumerate(request.snapshots):
        if snapshot.collected_at > now + MAX_FUTURE_SKEW_SECONDS:
            raise SnapshotRejected(
                f"snapshot {snapshot.sequence} was collected {snapshot.collected_at - now:.0f} s"
                " ahead of the server's clock: the agent's clock runs ahead, or the"
                " server's runs behind; check both",
                index=index,
            )
    # Lock the host first: on Postgres this queues a concurrent request of the same
    # host here, before it can insert its keys.
    state = HostState.load(session=session, dialect=dialect, host_id=host_id, cache=cache)
    if push_interval is not None:  # before applying: the gaps it judges are counted in it
        state.host.push_interval_seconds = push_interval
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
    ordered = sorted(to_apply)
    stepped = 0
    for done, (at, _, index) in enumerate(ordered):
        if done and out_of_time is not None and out_of_time():
            _defer(session, host_id, request.snapshots, results, [i for _, _, i in ordered[done:]])
            break
        newest = state.host.last_seen_at
        clock_stepped = False
        if newest is not None and at <= newest:
            snapshot = request.snapshots[index]
            if not _after_last_applied(state, snapshot):
                results[index] = "late"
                continue
            # The agent's clock stepped back (NTP, a VM restore): see _stepped_time.
            at = _stepped_time(newest, now)
            clock_stepped = True
        if work is not None and not work.admit(request.snapshots[index]):
            _defer(session, host_id, request.snapshots, results, [i for _, _, i in ordered[done:]])
            break
        stepped += clock_stepped
        apply_snapshot(state, request.snapshots[index], settings=settings, at=at)
    if stepped:
        log.warning(
            "host %s: %d snapshot(s) newer than the last applied (same boot, higher"
            " sequence) but not by their time: the agent's clock stepped back; applied"
            " at the server's receive time",
            state.host.hostname,
            stepped,
        )
    late = results.count("late")
    if late:
        log.info("host %s: %d late snapshot(s) recorded without replay", state.host.hostname, late)
    state.host.last_received_at = now
    # The agent's drop counter as of this request: the same whether the batch is
    # stored whole or in part, so a partial batch keeps it too. Overwritten, not
    # added: the agent sends the total of all its runs on its spool directory (kept
    # there across restarts), so a restarted agent does not take it back to 0.
    if request.spool_dropped_total is not None:
        state.host.spool_dropped_total = request.spool_dropped_total
    state.events.clear(SILENT_KEY, at=now)
    state.flush()
    return IngestResult(
        results=results, opened=state.events.opened, kept=state.kept(), clock_stepped=stepped
    )


def _after_last_applied(state: HostState, snapshot: HostSnapshot) -> bool:
    """True when ``snapshot`` is newer than the host's last applied one by definition:
    the same agent and boot, a higher sequence. Sequences only grow within an agent's
    boot, whatever its clock does, so this holds when its clock stepped back; a retry
    or a spool replay has the same or a lower sequence."""
    host = state.host
    return (
        host.last_sequence is not None
        and snapshot.agent_id == host.agent_id
        and snapshot.boot_id == host.boot_id
        and snapshot.sequence > host.last_sequence
    )


def _stepped_time(newest: float, now: float) -> float:
    """The effective time of a snapshot from a clock that stepped back: the server's
    receive time, which keeps following true time through the step, so durations
    (idle, leaks, silence) keep growing; or, when the host's state is already at that
    time (several such snapshots in one request), the least time after it, so the
    host's state never moves backwards."""
    return now if now > newest else math.nextafter(newest, math.inf)


def _defer(
    session: Session,
    host_id: int,
    snapshots: list[HostSnapshot],
    results: list[ItemResult],
    indices: list[int],
) -> None:
    """Answer the snapshots at ``indices`` ``deferred`` and forget their keys, so that
    resent they are stored as new. A repeat of one of their keys later in the batch
    (answered ``duplicate`` of it) is deferred with it: nothing of that key is stored."""
    keys = {snapshots[index].idempotency_key for index in indices}
    for index, snapshot in enumerate(snapshots):
        # Keys in ``keys`` were new to this request: a ``duplicate`` among them is a
        # repeat within the batch, never one an earlier request stored.
        if snapshot.idempotency_key in keys:
            results[index] = "deferred"
    session.connection().execute(
        _delete_seen(),
        [
            {"host": host_id, "agent": agent_id, "boot": boot_id, "seq": sequence}
            for agent_id, boot_id, sequence in keys
        ],
    )


@cache
def _delete_seen() -> Delete:
    return delete(_SEEN).where(
        _SEEN.c.host_id == bindparam("host"),
        _SEEN.c.agent_id == bindparam("agent"),
        _SEEN.c.boot_id == bindparam("boot"),
        _SEEN.c.sequence == bindparam("seq"),
    )


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
    fresh = {(agent_id, boot_id, sequence) for agent_id, boot_id, sequence in inserted}
    if len(fresh) < len(rows):
        fresh |= _reused_keys(session, host_id, {k: r for k, r in rows.items() if k not in fresh})
    return fresh


def _reused_keys(
    session: Session, host_id: int, stored: dict[tuple[str, str, int], dict[str, object]]
) -> set[tuple[str, str, int]]:
    """The keys of ``stored`` (already in ``snapshots_seen``) that name new snapshots, not
    retries: the stored ``collected_at`` differs. Their rows take the new snapshot's times,
    so a retry of it is a duplicate.

    An agent whose memory was restored (a VM snapshot) sends again the sequences it sent
    after that point, with what it sees now: answered ``duplicate``, they were dropped
    by the agent and the host froze for as long as the VM had run past its snapshot. A
    retry repeats the snapshot exactly, so its time is the stored one.
    """
    keys = list(stored)
    found = session.execute(
        select(_SEEN.c.agent_id, _SEEN.c.boot_id, _SEEN.c.sequence, _SEEN.c.collected_at).where(
            _SEEN.c.host_id == host_id,
            tuple_(_SEEN.c.agent_id, _SEEN.c.boot_id, _SEEN.c.sequence).in_(keys),
        )
    ).all()
    reused = {
        (agent_id, boot_id, sequence)
        for agent_id, boot_id, sequence, collected_at in found
        if collected_at != stored[(agent_id, boot_id, sequence)]["collected_at"]
    }
    if reused:
        session.connection().execute(
            _update_seen(),
            [
                {
                    "host": host_id,
                    "agent": key[0],
                    "boot": key[1],
                    "seq": key[2],
                    "collected": stored[key]["collected_at"],
                    "received": stored[key]["received_at"],
                }
                for key in reused
            ],
        )
        log.warning(
            "host %s: %d snapshot(s) reuse the key of a stored one with another time (the"
            " agent's memory restored, e.g. a VM snapshot?): stored as new",
            host_id,
            len(reused),
        )
    return reused


@cache
def _update_seen() -> Update:
    return (
        update(_SEEN)
        .where(
            _SEEN.c.host_id == bindparam("host"),
            _SEEN.c.agent_id == bindparam("agent"),
            _SEEN.c.boot_id == bindparam("boot"),
            _SEEN.c.sequence == bindparam("seq"),
        )
        .values(collected_at=bindparam("collected"), received_at=bindparam("received"))
    )


@cache
def _insert_seen(dialect: str) -> ReturningInsert[str, str, int]:
    # Built once per dialect: a reused statement object skips SQLAlchemy's cache-key
    # generation, on every ingest request.
    return insert_ignoring_conflicts(_SEEN, dialect).returning(
        _SEEN.c.agent_id, _SEEN.c.boot_id, _SEEN.c.sequence
    )
