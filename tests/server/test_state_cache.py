"""The host state a server process keeps between pushes: used when current, never when
another replica or a job changed the host since (ingest/cache.py)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from fastapi import FastAPI
from sqlalchemy import event, select

from gpuwatch.server import jobs
from gpuwatch.server.app import create_app
from gpuwatch.server.database import Database
from gpuwatch.server.events.models import Event
from gpuwatch.server.ingest.cache import HostStateCache, KeptState
from gpuwatch.server.processes.models import ProcessLifetime
from gpuwatch.settings import ServerSettings
from server.factories import body, gpu, process, snapshot
from server.harness import FakeClock, Live, serve


@pytest.fixture
def replica(settings: ServerSettings, database: Database, clock: FakeClock) -> Iterator[Live]:
    """A second server on the same database: its own process state, its own cache."""
    other: FastAPI = create_app(settings, clock=clock, engine=database.engine)
    with serve(other) as url, httpx.Client(base_url=url, timeout=10) as client:
        yield Live(url=url, client=client, database=database, clock=clock)


def statements(database: Database) -> list[str]:
    seen: list[str] = []

    def record(_conn: object, _cursor: object, sql: str, *_args: object) -> None:
        seen.append(sql)

    event.listen(database.engine, "before_cursor_execute", record)
    return seen


def lifetime(database: Database, pid: int) -> ProcessLifetime:
    with database.reader() as session:
        return session.scalars(select(ProcessLifetime).where(ProcessLifetime.pid == pid)).one()


def test_a_steady_push_reads_no_lifetimes_or_events_again(live: Live) -> None:
    token = live.token()
    procs = [process(100), process(101)]
    assert live.push(token, body(snapshot(0, [gpu(0, procs)]))).status_code == 200
    seen = statements(live.database)

    assert live.push(token, body(snapshot(1, [gpu(0, procs)]))).status_code == 200

    reads = [sql for sql in seen if sql.lstrip().upper().startswith("SELECT")]
    assert not [sql for sql in reads if "FROM process_lifetimes" in sql], reads
    assert not [sql for sql in reads if "FROM events" in sql], reads
    assert lifetime(live.database, 100).last_seen_at == snapshot(1, []).collected_at


def test_a_push_stored_by_another_replica_makes_the_kept_copy_stale(
    live: Live, replica: Live
) -> None:
    token = live.token()
    assert live.push(token, body(snapshot(0, [gpu(0, [process(100), process(101)])]))).is_success
    # The other replica sees 101 gone, and ends it there.
    assert replica.push(token, body(snapshot(1, [gpu(0, [process(100)])]))).is_success

    # A stale copy here would still hold 101 open and end it again, at this snapshot.
    assert live.push(token, body(snapshot(2, [gpu(0, [process(100)])]))).is_success

    assert lifetime(live.database, 101).ended_at == snapshot(1, []).collected_at
    assert lifetime(live.database, 100).last_seen_at == snapshot(2, []).collected_at


def test_the_silence_job_makes_the_kept_copy_stale(
    live: Live, settings: ServerSettings, clock: FakeClock
) -> None:
    token = live.token()
    procs = [process(100)]
    assert live.push(token, body(snapshot(0, [gpu(0, procs)]))).is_success
    clock.advance(jobs.silence_threshold_seconds(settings) + 60)
    assert jobs.detect_silent_agents(database=live.database, settings=settings, now=clock()) == 1

    # The agent is back: its push closes the event the job opened after the copy was kept.
    late = snapshot(1, [gpu(0, procs)], at=clock())
    assert live.push(token, body(late)).is_success

    with live.database.reader() as session:
        silent = session.scalars(select(Event).where(Event.kind == "agent_silent")).one()
    assert silent.ended_at == clock()


def test_events_opened_from_a_kept_copy_are_updated_not_inserted_again(live: Live) -> None:
    token = live.token()
    orphan = [process(100, orphaned=True)]
    for sequence in range(3):
        assert live.push(token, body(snapshot(sequence, [gpu(0, orphan)]))).is_success

    with live.database.reader() as session:
        rows = session.scalars(select(Event).where(Event.kind == "orphaned")).all()
    assert [(row.ended_at, row.last_seen_at) for row in rows] == [
        (None, snapshot(2, []).collected_at)
    ]


def kept(version: int) -> KeptState:
    return KeptState(version=version, gpus=[], lifetimes=[], events=[], windows={}, gpu_windows={})


def test_cache_hands_out_a_copy_once_and_only_at_its_version() -> None:
    cache = HostStateCache(max_entries=8)
    cache.put(1, kept(3))
    assert cache.take(1, 4) is None  # stale: dropped
    assert cache.take(1, 3) is None
    cache.put(1, kept(3))
    assert cache.take(1, 3) == kept(3)
    assert cache.take(1, 3) is None  # in use by the request that took it


def test_cache_forgets_the_least_recently_used_host_and_can_be_off() -> None:
    cache = HostStateCache(max_entries=2)
    for host_id in (1, 2, 3):
        cache.put(host_id, kept(0))
    assert len(cache) == 2 and cache.take(1, 0) is None
    off = HostStateCache(max_entries=0)
    off.put(1, kept(0))
    assert len(off) == 0


def test_a_changed_owner_is_written_though_most_pushes_write_only_what_moves(live: Live) -> None:
    token = live.token()
    for sequence, user in enumerate(["alice", "alice", "bob", "bob"]):
        procs = [process(100, user=user, used_gib=4 + sequence)]
        assert live.push(token, body(snapshot(sequence, [gpu(0, procs)]))).is_success

    row = lifetime(live.database, 100)
    assert (row.user, row.current_bytes, row.peak_bytes) == ("bob", 7 * 2**30, 7 * 2**30)
    assert row.last_seen_at == snapshot(3, []).collected_at
