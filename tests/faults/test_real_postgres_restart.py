"""Postgres restarted for real under a running ``gpuwatch server``, mid-ingest.

The proxy version (``test_database_outage.py``) shows what the server sees of a
restart; this one does it: a private cluster (``private_postgres.py``, never the
shared one) restarted with ``pg_ctl restart -m fast`` (sessions terminated, a
checkpoint) or ``-m immediate`` (a crash: no checkpoint, WAL replayed at start) while
the real reporter pushes real snapshots over HTTP to a real ``gpuwatch server``
process. Then stopped and held down until a push has met the outage, and started
again. The promise: while the database is away pushes are answered 503 with
``Retry-After`` (never a 500), the reporter backs off, and after it returns every
snapshot offered is stored exactly once; the server logs no ERROR.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from server.factories import body
from server.harness import make_token
from sqlalchemy import create_engine, text
from support.clock import FakeClock

from faults.central import HOST, delivered, host_snapshot, reporter
from faults.private_postgres import PrivateCluster, private_cluster
from faults.server_process import ServerProcess, wait_for
from gpuwatch.agent.reporter import DrainResult, Reporter, ReporterStats
from gpuwatch.server.app import RETRY_AFTER_SECONDS
from gpuwatch.server.database import create_database

# Between pushes: the agent's loop, many times faster (its push interval is 15 s).
PUSH_PACE_SECONDS = 0.02


@pytest.fixture(scope="module")
def cluster() -> Iterator[PrivateCluster]:
    with private_cluster() as started:
        yield started


@pytest.fixture
def database_url(cluster: PrivateCluster) -> Iterator[str]:
    """A fresh database of the private cluster, for one test."""
    name = f"gw_{uuid.uuid4().hex[:12]}"
    admin = create_engine(cluster.url(), isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
    finally:
        admin.dispose()
    yield cluster.url(name)


class Pusher(threading.Thread):
    """The agent's loop, fast: offer a snapshot (stamped with the real time the server
    judges skew by), drain, and on a refusal check the reporter holds off until its
    backoff ends before moving its fake monotonic clock past it."""

    def __init__(self, agent: Reporter, clock: FakeClock) -> None:
        super().__init__(daemon=True)
        self.agent, self.clock = agent, clock
        self.offered = 0
        self.refusals: list[DrainResult] = []
        self.held_off: list[str | None] = []  # the drain right after each refusal
        self.finish = threading.Event()
        self.failed: BaseException | None = None

    def run(self) -> None:
        try:
            while not self.finish.wait(PUSH_PACE_SECONDS):
                self.agent.offer(host_snapshot(self.offered, time.time()))
                self.offered += 1
                result = self.agent.drain_once()
                if result.stopped_by is not None:
                    self.refusals.append(result)
                    self.held_off.append(self.agent.drain_once().stopped_by)
                    self.clock.advance(result.retry_in_seconds or 0)
        except BaseException as err:  # reported by the test, not lost in a thread
            self.failed = err

    def stored_so_far(self) -> int:
        if self.failed is not None:  # fail the wait now, not at its deadline
            raise AssertionError(f"the pusher thread failed: {self.failed!r}")
        return delivered(self.agent.stats())


def stored(url: str) -> Counter[int]:
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(text("SELECT sequence FROM snapshots_seen")).scalars()
            return Counter(int(s) for s in rows)
    finally:
        engine.dispose()


@pytest.mark.parametrize("mode", ["fast", "immediate"])
def test_postgres_restarted_mid_ingest_is_503_then_every_snapshot_is_stored_once(
    mode: str, cluster: PrivateCluster, database_url: str, tmp_path: Path
) -> None:
    server = ServerProcess(tmp_path, database_url)  # migrates the fresh database
    try:
        pusher, direct, final, stats = _restart_under_ingest(mode, cluster, server, tmp_path)
        rows = stored(database_url)
    finally:
        server.stop()
        cluster.ensure_started()  # for the next test, whatever happened in this one

    assert direct.status_code == 503, direct.text
    assert direct.headers["Retry-After"] == str(RETRY_AFTER_SECONDS)
    # The agent met the outage as 503s only (batches: success and throttled, no
    # server_error, unexpected_status, unreachable), each answered with a backoff of
    # at least Retry-After that it honoured (the next drain sent nothing).
    assert set(stats.batches_total) == {"success", "throttled"}, stats.batches_total
    assert pusher.refusals and all(r.stopped_by == "throttled" for r in pusher.refusals)
    assert all((r.retry_in_seconds or 0) >= RETRY_AFTER_SECONDS for r in pusher.refusals)
    assert set(pusher.held_off) == {"backoff"}
    # 0 lost, 0 duplicated: every offered sequence stored exactly once.
    assert final.pending == 0 and stats.dropped_total == {}
    assert delivered(stats) == pusher.offered
    assert sorted(rows) == list(range(pusher.offered))  # the refused direct push: not
    assert max(rows.values()) == 1
    assert server.errors() == []


def _drained(agent: Reporter, clock: FakeClock) -> DrainResult | None:
    result = agent.drain_once()
    if result.stopped_by is not None:
        clock.advance(result.retry_in_seconds or 0)
        return None
    return result


def _restart_under_ingest(
    mode: str, cluster: PrivateCluster, server: ServerProcess, tmp_path: Path
) -> tuple[Pusher, httpx.Response, DrainResult, ReporterStats]:
    """Push all along; restart, then stop, meet the outage, start; drain the spool."""
    database = create_database(server.database_url)
    try:
        token = make_token(database, HOST, time.time())
    finally:
        database.dispose()
    clock = FakeClock(0.0)
    agent = reporter(server.url, token, tmp_path / "spool", clock)
    pusher = Pusher(agent, clock)
    pusher.start()
    try:
        wait_for(lambda: pusher.stored_so_far() >= 3, "the first snapshots stored")

        # 1. A restart while snapshots flow: whatever it cuts, nothing may 500.
        cluster.restart(mode)
        after_restart = pusher.stored_so_far()
        wait_for(lambda: pusher.stored_so_far() >= after_restart + 3, "ingest after restart")

        # 2. The same restart held open until a push has met it, to see the 503 itself.
        cluster.stop(mode)
        refused_before = len(pusher.refusals)
        wait_for(lambda: len(pusher.refusals) > refused_before, "a push refused while down")
        direct = httpx.post(
            f"{server.url}/api/v1/snapshots",
            json=body(host_snapshot(10**6, time.time())),
            headers={"Authorization": f"Bearer {token}"},
            timeout=30,
        )
        cluster.start()
        after_start = pusher.stored_so_far()
        wait_for(lambda: pusher.stored_so_far() >= after_start + 3, "ingest after start")
    finally:
        pusher.finish.set()
        pusher.join(timeout=60)
    try:
        assert pusher.failed is None, pusher.failed
        final = wait_for(lambda: _drained(agent, clock), "the spool to drain")
        return pusher, direct, final, agent.stats()
    finally:
        agent.close()
