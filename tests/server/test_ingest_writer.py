"""The ingest writer stores pushes queued together in one transaction, each with its own
answer, and one push's refusal or bad data costs the others nothing.

Over real HTTP to the real app, on SQLite and Postgres. Pushes are made to queue by
holding the writer up: on SQLite the test holds the process's write turn, on
Postgres a lock on the first host's row. The writer has one thread here, so which
pushes share a transaction is certain.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from sqlalchemy import event, select, text
from sqlalchemy.orm import Session

from gpuwatch.server.auth.service import identity_of_digest, revoke_tokens, token_digest
from gpuwatch.server.database import Database
from gpuwatch.server.deps import PushCredential
from gpuwatch.server.hosts.models import Host
from gpuwatch.server.ingest.body import Deadline
from gpuwatch.server.ingest.models import SnapshotSeen
from gpuwatch.server.ingest.writer import IngestWriter, OverBudget, Pending, Push, Stored
from gpuwatch.wire import IngestRequest
from server.factories import T0, body, gpu, process, snapshot
from server.harness import FakeClock, Live, make_token, serve
from server.test_ingest_rejects import TestQuarantine as Rejects


@pytest.fixture
def writer(app: FastAPI) -> Iterator[IngestWriter]:
    """One writer thread, and batches as long as the pushes waiting."""
    writer = IngestWriter(app.state.gpuwatch, threads=1, batch_seconds=60.0)
    app.state.ingest_writer = writer
    yield writer
    writer.close()


@pytest.fixture
def live(
    app: FastAPI, writer: IngestWriter, database: Database, clock: FakeClock
) -> Iterator[Live]:
    with serve(app) as url, httpx.Client(base_url=url, timeout=30) as client:
        yield Live(url=url, client=client, database=database, clock=clock)


class Commits:
    """Counts the ingest writer's commits, and the host ids each of its transactions
    locked up front and loaded, in order (the test's own sessions are not counted)."""

    def __init__(self, database: Database) -> None:
        self.count = 0
        self.loads: list[list[int]] = [[]]
        self.locks: list[list[int]] = [[]]
        engine = database.engine
        event.listen(engine, "commit", self._commit)
        event.listen(engine, "before_execute", self._execute)

    def _commit(self, _conn: Any) -> None:
        if not _in_writer():
            return
        self.count += 1
        self.loads.append([])
        self.locks.append([])

    def _execute(self, _conn: Any, clause: Any, multiparams: Any, params: Any, _opts: Any) -> None:
        if not _in_writer():
            return
        given = params or (multiparams[0] if multiparams else {})
        if not isinstance(given, dict) or "FROM hosts" not in str(clause):
            return
        if "host_id" in given:
            self.loads[-1].append(given["host_id"])
            return
        compiled = clause.compile(dialect=_conn.dialect)
        if "FOR UPDATE" in str(compiled):  # the ids are the statement's own values
            self.locks[-1] += [i for value in compiled.params.values() for i in value]


def _in_writer() -> bool:
    return threading.current_thread().name.startswith("ingest-writer")


@contextmanager
def held(database: Database, hostname: str) -> Iterator[Session]:
    """Hold the writer up at its first push (``hostname``'s): yield a session whose
    transaction is committed on the way out, which lets it go."""
    if database.dialect == "sqlite":
        with database.writer() as session:  # the process's write turn
            yield session
            session.commit()
        return
    with database.writer() as session:
        session.execute(
            text("SELECT id FROM hosts WHERE hostname = :h FOR UPDATE"), {"h": hostname}
        )
        yield session
        session.commit()


def _queue_pushes(
    live: Live, writer: IngestWriter, pushes: list[tuple[str, dict[str, Any]]]
) -> tuple[list[threading.Thread], dict[int, httpx.Response]]:
    """Send ``pushes`` (token, body) one after another, each once the one before is
    queued (the first is taken up by the writer and held)."""
    answers: dict[int, httpx.Response] = {}
    threads = []
    for n, (token, payload) in enumerate(pushes):

        def send(n: int = n, token: str = token, payload: dict[str, Any] = payload) -> None:
            answers[n] = live.client.post(
                "/api/v1/snapshots", json=payload, headers={"Authorization": f"Bearer {token}"}
            )

        thread = threading.Thread(target=send)
        thread.start()
        threads.append(thread)
        deadline = time.monotonic() + 10
        # The first push is taken up by the writer and held; the others queue.
        while not (_writer_waits(live.database) if n == 0 else writer.queued == n):
            assert time.monotonic() < deadline, f"push {n} never queued"
            time.sleep(0.002)
    return threads, answers


def _writer_waits(database: Database) -> bool:
    """Whether a writer waits for what :func:`held` holds."""
    if database.dialect == "sqlite":
        turns = database.write_turns
        assert turns is not None
        return turns.waiting > 0
    with database.reader() as session:
        waiting = session.scalar(
            text(
                "SELECT count(*) FROM pg_stat_activity"
                " WHERE datname = current_database() AND wait_event_type = 'Lock'"
            )
        )
    return bool(waiting)


def _join(threads: list[threading.Thread]) -> None:
    for thread in threads:
        thread.join(timeout=60)
        assert not thread.is_alive()


def _seen(database: Database) -> dict[str, list[int]]:
    with database.reader() as session:
        rows = session.execute(
            select(Host.hostname, SnapshotSeen.sequence)
            .join(Host, Host.id == SnapshotSeen.host_id)
            .order_by(SnapshotSeen.sequence)
        ).all()
    seen: dict[str, list[int]] = {}
    for hostname, sequence in rows:
        seen.setdefault(hostname, []).append(sequence)
    return seen


def _hosts(live: Live, count: int) -> list[str]:
    """Tokens of host-0 … host-<count-1>, after one first push each (which creates
    the host's rows, so every later push is of a known host)."""
    tokens = []
    for n in range(count):
        token = make_token(live.database, f"host-{n}", live.clock())
        first = live.push(token, body(snapshot(0, [gpu(0)], hostname=f"host-{n}")))
        assert first.status_code == 200, first.text
        tokens.append(token)
    return tokens


def test_pushes_queued_together_share_one_transaction_and_keep_their_own_answers(
    live: Live, writer: IngestWriter
) -> None:
    tokens = _hosts(live, 6)
    live.clock.advance(60)

    def of(n: int, *seqs: int, **fields: Any) -> tuple[str, dict[str, Any]]:
        snaps = [
            snapshot(seq, [gpu(0, [process(100 + seq)])], hostname=f"host-{n}", **fields)
            for seq in seqs
        ]
        return tokens[n], body(*snaps)

    # Hosts out of id order; host-2 twice in order; a resend; a snapshot already stored.
    pushes = [of(0, 1), of(5, 1), of(2, 1), of(2, 2, 3), of(4, 1), of(4, 1), of(1, 0, 1)]
    commits = Commits(live.database)
    with held(live.database, "host-0"):
        threads, answers = _queue_pushes(live, writer, pushes)
        assert commits.count == 0
    _join(threads)

    assert [answers[n].status_code for n in range(len(pushes))] == [200] * len(pushes)
    results = [answers[n].json()["results"] for n in range(len(pushes))]
    assert results == [
        ["accepted"],
        ["accepted"],
        ["accepted"],
        ["accepted", "accepted"],
        ["accepted"],
        ["duplicate"],
        ["duplicate", "accepted"],
    ]
    # The held push alone, then the six that queued behind it together, in the order
    # they came; on Postgres, their hosts locked first, in id order.
    assert commits.count == 2
    ids = _host_ids(live.database)
    assert commits.loads[1] == [ids[f"host-{n}"] for n in (5, 2, 2, 4, 4, 1)]
    if live.database.dialect == "postgresql":
        assert commits.locks[1] == sorted(ids[f"host-{n}"] for n in (1, 2, 4, 5))
    else:
        assert commits.locks[1] == []  # one writer at a time: nothing to order
    assert _seen(live.database) == {
        "host-0": [0, 1],
        "host-1": [0, 1],
        "host-2": [0, 1, 2, 3],
        "host-3": [0],
        "host-4": [0, 1],
        "host-5": [0, 1],
    }
    # host-2's pushes applied in order: its newest is the second push's last snapshot.
    with live.database.reader() as session:
        newest = session.scalar(select(Host.last_sequence).where(Host.hostname == "host-2"))
    assert newest == 3


def _host_ids(database: Database) -> dict[str, int]:
    with database.reader() as session:
        return {name: host_id for host_id, name in session.execute(select(Host.id, Host.hostname))}


def test_a_poisoned_push_in_a_batch_is_quarantined_and_costs_the_others_nothing(
    live: Live, writer: IngestWriter
) -> None:
    tokens = _hosts(live, 4)
    live.clock.advance(60)
    Rejects.poison_gpu_names(live.database)
    good = [
        (tokens[n], body(snapshot(1, [gpu(0, [process(100)])], hostname=f"host-{n}")))
        for n in (0, 1, 3)
    ]
    poisoned = (
        tokens[2],
        body(snapshot(1, [gpu(0), gpu(1, name="poison")], hostname="host-2")),
    )
    commits = Commits(live.database)
    with held(live.database, "host-0"):
        threads, answers = _queue_pushes(live, writer, [good[0], good[1], poisoned, good[2]])
    _join(threads)

    assert [answers[n].status_code for n in range(4)] == [200, 200, 422, 200]
    (error,) = answers[2].json()["detail"]
    assert error["type"] == "quarantined"
    assert _seen(live.database) == {
        "host-0": [0, 1],
        "host-1": [0, 1],
        "host-2": [0],
        "host-3": [0, 1],
    }
    # The held push; host-1 stored again alone (the shared transaction rolled back at
    # host-2, which is quarantined alone); host-3, not reached, in the next batch.
    assert commits.count == 1 + 2
    metrics = live.client.get("/metrics").text
    assert 'gpuwatch_server_ingest_requests_total{result="quarantined"} 1.0' in metrics


def test_a_token_revoked_while_its_push_queued_is_403_and_the_rest_are_stored(
    live: Live, writer: IngestWriter
) -> None:
    tokens = _hosts(live, 3)
    live.clock.advance(60)
    pushes = [(tokens[n], body(snapshot(1, [gpu(0)], hostname=f"host-{n}"))) for n in range(3)]
    with held(live.database, "host-0") as session:
        threads, answers = _queue_pushes(live, writer, pushes)
        assert revoke_tokens(session=session, hostname="host-1", now=live.clock()) == 1
    _join(threads)

    assert [answers[n].status_code for n in range(3)] == [200, 403, 200]
    assert _seen(live.database) == {"host-0": [0, 1], "host-1": [0], "host-2": [0, 1]}


def test_a_batch_past_its_time_stores_the_rest_in_the_next_oldest_first(
    app: FastAPI, live: Live, writer: IngestWriter
) -> None:
    tokens = _hosts(live, 4)
    live.clock.advance(60)
    writer.batch_seconds = 0.0  # every push after a batch's first waits for the next
    # Queued against id order: the pushes a batch had no time for must keep their
    # place, not give it to lower host ids, or a busy server passes some over for ever.
    order = [0, 3, 2, 1]
    pushes = [(tokens[n], body(snapshot(1, [gpu(0)], hostname=f"host-{n}"))) for n in order]
    commits = Commits(live.database)
    with held(live.database, "host-0"):
        threads, answers = _queue_pushes(live, writer, pushes)
    _join(threads)

    assert [answers[n].status_code for n in range(4)] == [200] * 4
    assert commits.count == 4
    ids = _host_ids(live.database)
    assert commits.loads[:4] == [[ids[f"host-{n}"]] for n in order]
    assert _seen(live.database) == {f"host-{n}": [0, 1] for n in range(4)}


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_the_write_turn_not_coming_is_503_for_every_push_of_the_batch(
    live: Live, writer: IngestWriter, database: Database
) -> None:
    tokens = _hosts(live, 3)
    live.clock.advance(60)
    turns = database.write_turns
    assert turns is not None
    turns.timeout_seconds = 0.5
    pushes = [(tokens[n], body(snapshot(1, [gpu(0)], hostname=f"host-{n}"))) for n in range(3)]
    with held(live.database, "host-0"):
        threads, answers = _queue_pushes(live, writer, pushes)
        _join(threads)  # answered while the turn is still held
    turns.timeout_seconds = 5.0

    assert [answers[n].status_code for n in range(3)] == [503] * 3
    assert all(answers[n].headers["Retry-After"] for n in range(3))
    assert _seen(live.database) == {f"host-{n}": [0] for n in range(3)}


class Ticking:
    """Monotonic seconds that move one each time they are read."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        now = self.now
        self.now += 1.0
        return now


def _push(database: Database, tokens: list[str], n: int, snaps: int, deadline: Deadline) -> Push:
    """host-``n``'s push of ``snaps`` snapshots, parsed, for ``writer._store_together``."""
    payload = body(*(snapshot(seq, [gpu(0)], hostname=f"host-{n}") for seq in range(1, snaps + 1)))
    digest = token_digest(tokens[n])
    assert digest is not None
    with database.reader() as session:
        identity = identity_of_digest(session=session, digest=digest)
    assert identity is not None
    credential = PushCredential(identity=identity, token_sha256=digest, cached=True, client="")
    return Push(
        raw=bytearray(json.dumps(payload).encode()),
        credential=credential,
        deadline=deadline,
        partial=True,
        loop=None,  # type: ignore[arg-type]  # nothing settles through it here
        future=None,  # type: ignore[arg-type]
        body=IngestRequest.model_validate(payload),
    )


def test_a_push_is_cut_short_at_the_budget_of_the_pushes_waiting_for_its_commit(
    live: Live, writer: IngestWriter, database: Database
) -> None:
    """A push done early in a batch is answered only at the batch's commit: a long one
    after it is deferred at the first one's budget, not its own."""
    tokens = _hosts(live, 2)
    live.clock.advance(60)
    ticking = Ticking()

    live.clock.now = max(live.clock.now, T0 + 15 * 8)
    # Clock reads: both budgets, for how long the batch may wait for its turn (0, 1);
    # host-0's budget (2), then before host-1's push host-0's (3) and its own (4), then
    # before each of host-1's snapshots after the first the earlier of the two,
    # host-0's: 5 (not passed) and 6 (passed). Its own is far off.
    first = _push(database, tokens, 0, 1, Deadline(at=6.0, clock=ticking))
    long = _push(database, tokens, 1, 8, Deadline(at=1000.0, clock=ticking))
    outcomes, carried = writer._store_together([first, long])

    assert carried == []
    answers = {p.credential.identity.hostname: o for p, o in outcomes}
    assert isinstance(answers["host-0"], Stored) and isinstance(answers["host-1"], Stored)
    assert answers["host-0"].deferred == 0
    assert answers["host-1"].deferred == 6
    assert _seen(database) == {"host-0": [0, 1], "host-1": [0, 1, 2]}


def test_idle_writer_threads_share_the_pushes_waiting_and_the_last_one_stops_them() -> None:
    """A thread takes its even share with the threads idle beside it, not the whole
    queue (which it would then store one after another while they waited)."""
    pending = Pending()
    taken: list[list[Any] | None] = []

    def take() -> None:
        taken.append(pending.take(64))

    threads = [threading.Thread(target=take) for _ in range(2)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 5
    while pending._idle < 2:  # both waiting before anything arrives
        assert time.monotonic() < deadline, "the threads never waited"
        time.sleep(0.001)
    pushes: list[Any] = [object() for _ in range(5)]
    pending.put_back(pushes)
    _join(threads)
    assert sorted(len(batch or []) for batch in taken) == [2, 3]
    assert [p for batch in taken for p in batch or []] in (pushes, pushes[3:] + pushes[:3])
    assert len(pending) == 0
    pending.close()
    assert pending.take(64) is None


class StepClock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _taker(pending: Pending, most: int) -> tuple[threading.Thread, list[Any]]:
    taken: list[Any] = []
    thread = threading.Thread(target=lambda: taken.append(pending.take(most)))
    thread.start()
    return thread, taken


def test_a_batch_waits_for_company_only_while_pushes_come_often() -> None:
    """Under load a batch waits (up to the linger) for pushes to share its transaction
    with; pushes that come seldom are taken at once, and so is a full batch."""
    clock = StepClock()
    pending = Pending(linger=0.05, clock=clock)
    seldom = [object(), object()]
    for push in seldom:
        clock.now += 1.0  # a second apart: waiting would gather nobody
        pending.put(push)  # type: ignore[arg-type]
    assert pending.take(4) == seldom  # at once: the oldest has not waited the linger

    rush: list[Any] = [object() for _ in range(30)]
    for push in rush:  # from now on pushes come 1 ms apart
        clock.now += 0.001
        pending.put(push)
    clock.now += 0.05
    assert pending.take(64) == rush  # the oldest has waited the whole linger

    often: list[Any] = [object() for _ in range(4)]
    for push in often[:2]:
        clock.now += 0.001
        pending.put(push)
    thread, taken = _taker(pending, 4)
    deadline = time.monotonic() + 5
    while pending._idle < 1:  # lingering: the oldest has waited 1 ms of its 50
        assert time.monotonic() < deadline, "the thread never waited"
        time.sleep(0.001)
    time.sleep(0.02)
    assert taken == [], "took the batch before it was full or the linger was up"
    for push in often[2:]:
        clock.now += 0.001
        pending.put(push)
    _join([thread])
    assert taken == [often]  # full: taken as soon as the fourth came

    late: list[Any] = [object(), object()]
    for push in late:
        clock.now += 0.001
        pending.put(push)
    clock.now += 0.05
    assert pending.take(4) == late


def test_pushes_put_back_are_not_kept_waiting_for_company() -> None:
    clock = StepClock()
    pending = Pending(linger=3600.0, clock=clock)
    pending.put(object())  # type: ignore[arg-type]
    pending.take(1)
    carried: list[Any] = [object()]
    pending.put_back(carried)
    assert pending.take(64) == carried


def test_a_lingering_thread_stops_when_the_writer_closes() -> None:
    clock = StepClock()
    pending = Pending(linger=3600.0, clock=clock)
    for push in [object(), object()]:
        clock.now += 0.001
        pending.put(push)  # type: ignore[arg-type]
    thread, taken = _taker(pending, 64)
    deadline = time.monotonic() + 5
    while pending._idle < 1:
        assert time.monotonic() < deadline, "the thread never waited"
        time.sleep(0.001)
    pending.close()
    _join([thread])
    assert len(taken[0]) == 2  # what was waiting is stored, not dropped
    assert pending.take(64) is None


def test_a_batch_waits_for_its_turn_or_locks_no_longer_than_its_earliest_budget(
    live: Live, writer: IngestWriter, database: Database
) -> None:
    """A job holding the write turn (SQLite) or a host's row (Postgres) must not add its
    wait to the time a push already queued: the push out of budget is answered 503 at
    its budget, and the others wait for the next batch."""
    tokens = _hosts(live, 2)
    live.clock.advance(60)
    soon = _push(database, tokens, 0, 1, Deadline.after(0.3, clock=time.monotonic))
    later = _push(database, tokens, 1, 1, Deadline.after(60.0, clock=time.monotonic))
    result: list[Any] = []
    with held(database, "host-0"):
        began = time.monotonic()
        thread = threading.Thread(
            target=lambda: result.append(writer._store_together([soon, later]))
        )
        thread.start()
        _join([thread])
        waited = time.monotonic() - began
    (outcomes, carried) = result[0]

    assert waited < 3.0, "waited for the turn's own timeout, not the push's budget"
    assert [(p, type(o)) for p, o in outcomes] == [(soon, OverBudget)]
    assert carried == [later]
    assert _seen(database) == {"host-0": [0], "host-1": [0]}
