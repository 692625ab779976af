"""The database goes away under a running server: Postgres restarted mid-ingest, and
SQLite locked by another writer.

Real parts: the server on a real database, the agent's reporter pushing over real HTTP
(backoff on an injected clock). Postgres is never restarted here (the cluster is
shared): a restart is what the server sees of it, its connections cut and new ones
refused, made with a TCP proxy between them or with ``pg_terminate_backend`` on the
server's own sessions. The promise: the server answers 503 with ``Retry-After``
(never a 500) while the database is away, the first push after it returns is stored,
and nothing is lost or stored twice.
"""

from __future__ import annotations

import logging
import random
import sqlite3
import threading
import time
from pathlib import Path

import httpx
import pytest
from server.factories import body
from support.clock import FakeClock

from faults.central import T0, Central, PostgresSchema, central, delivered, host_snapshot, reporter
from faults.proxy import proxy_to
from gpuwatch.agent.reporter import Reporter
from gpuwatch.server.app import RETRY_AFTER_SECONDS


def push_directly(server: Central, token: str, sequence: int) -> httpx.Response:
    """One push outside the reporter, to read the status and headers themselves."""
    snap = host_snapshot(sequence, server.clock())
    return httpx.post(
        f"{server.url}/api/v1/snapshots",
        json=body(snap),
        headers={"Authorization": f"Bearer {token}"},
        timeout=30,
    )


def offer(agent: Reporter, clock: FakeClock, first: int, count: int) -> None:
    for sequence in range(first, first + count):
        agent.offer(host_snapshot(sequence, clock()))
        clock.advance(15)


def no_server_errors(stats_batches: dict[str, int], caplog: pytest.LogCaptureFixture) -> None:
    """No 500 reached the agent, and the server logged no database error as a bug."""
    assert "server_error" not in stats_batches and "unexpected_status" not in stats_batches
    bugs = [
        r.getMessage()
        for r in caplog.records
        if r.name.startswith("gpuwatch.server") and r.levelno >= logging.ERROR
    ]
    assert bugs == []


# --- Postgres ----------------------------------------------------------------------------


@pytest.mark.postgres
def test_postgres_gone_is_503_then_the_first_push_after_it_returns_is_stored(
    postgres_schema: PostgresSchema, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    clock = FakeClock(T0)
    with (
        proxy_to(("127.0.0.1", 5432)) as database,
        central(postgres_schema.url(port=database.port), tmp_path, clock) as server,
    ):
        token = server.token()
        agent = reporter(server.url, token, tmp_path / "spool", clock)
        try:
            offer(agent, clock, 0, 3)
            assert agent.drain_once().stopped_by is None

            database.down()  # Postgres restarts: pooled connections die, new ones refused
            offer(agent, clock, 3, 3)
            refused = agent.drain_once()
            response = push_directly(server, token, 99)
            assert response.status_code == 503
            assert response.headers["Retry-After"] == str(RETRY_AFTER_SECONDS)
            assert refused.stopped_by == "throttled"
            assert refused.retry_in_seconds is not None
            assert refused.retry_in_seconds >= RETRY_AFTER_SECONDS
            assert agent.drain_once().stopped_by == "backoff"  # Retry-After honoured

            database.up()
            clock.advance(refused.retry_in_seconds)
            recovered = agent.drain_once()  # the pool was recycled: none lost to a dead one
            stats = agent.stats()
        finally:
            agent.close()
        stored = server.stored()

    assert recovered.stopped_by is None and recovered.delivered == 3
    assert stats.pending == 0 and stats.dropped_total == {}
    assert delivered(stats) == 6
    assert sorted(k[2] for k in stored) == list(range(6))
    assert max(stored.values()) == 1
    no_server_errors(stats.batches_total, caplog)


@pytest.mark.postgres
def test_postgres_sessions_killed_mid_ingest_lose_nothing_and_never_500(
    postgres_schema: PostgresSchema, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # The server's sessions are terminated every few tens of milliseconds while the
    # agent pushes: inside transactions, between them, during commits.
    clock = FakeClock(T0)
    pushes = 60
    stop = threading.Event()
    kills: list[int] = []

    def restarts() -> None:
        rng = random.Random(7)
        while not stop.wait(rng.uniform(0.01, 0.08)):
            kills.append(postgres_schema.terminate_sessions())

    with central(postgres_schema.url(), tmp_path, clock) as server:
        agent = reporter(server.url, server.token(), tmp_path / "spool", clock)
        killer = threading.Thread(target=restarts, daemon=True)
        killer.start()
        outcomes: list[str | None] = []
        try:
            for sequence in range(pushes):
                offer(agent, clock, sequence, 1)
                result = agent.drain_once()
                outcomes.append(result.stopped_by)
                if result.retry_in_seconds:
                    clock.advance(result.retry_in_seconds)
        finally:
            stop.set()
            killer.join()
        try:
            for _ in range(10):
                if agent.drain_once().stopped_by is None:
                    break
                clock.advance(60)
            stats = agent.stats()
        finally:
            agent.close()
        stored = server.stored()

    assert sum(kills) > 0, "no session was ever killed: the test exercised nothing"
    assert stats.pending == 0 and stats.dropped_total == {}
    assert delivered(stats) == pushes
    assert sorted(k[2] for k in stored) == list(range(pushes))
    assert max(stored.values()) == 1
    no_server_errors(stats.batches_total, caplog)


# --- SQLite ------------------------------------------------------------------------------


def integrity(db: Path) -> str:
    with sqlite3.connect(db) as conn:
        return str(conn.execute("PRAGMA integrity_check").fetchone()[0])


def test_sqlite_locked_by_another_writer_is_503_then_recovers(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    db = tmp_path / "central.db"
    clock = FakeClock(T0)
    with central(f"sqlite:///{db}", tmp_path, clock, busy_timeout_seconds=0.5) as server:
        token = server.token()
        agent = reporter(server.url, token, tmp_path / "spool", clock)
        # Another process's writer (a CLI, a second server) holds the write lock.
        other = sqlite3.connect(db, isolation_level=None, timeout=5)
        try:
            offer(agent, clock, 0, 2)
            assert agent.drain_once().stopped_by is None

            other.execute("BEGIN EXCLUSIVE")
            other.execute("UPDATE hosts SET last_received_at = last_received_at")
            started = time.monotonic()
            response = push_directly(server, token, 99)
            waited = time.monotonic() - started
            offer(agent, clock, 2, 2)
            refused = agent.drain_once()
            assert server.url and httpx.get(f"{server.url}/api/v1/hosts").status_code == 200
            other.execute("COMMIT")

            clock.advance(refused.retry_in_seconds or 0)
            recovered = agent.drain_once()
            stats = agent.stats()
        finally:
            other.close()
            agent.close()
        stored = server.stored()

    assert response.status_code == 503
    assert response.headers["Retry-After"] == str(RETRY_AFTER_SECONDS)
    assert waited < 5  # the busy timeout, not a hang
    assert refused.stopped_by == "throttled"
    assert recovered.stopped_by is None and recovered.delivered == 2
    assert stats.dropped_total == {} and delivered(stats) == 4
    assert sorted(k[2] for k in stored) == [0, 1, 2, 3]
    assert max(stored.values()) == 1
    assert integrity(db) == "ok"
    no_server_errors(stats.batches_total, caplog)


def test_a_lock_held_shorter_than_the_busy_timeout_only_delays_the_push(tmp_path: Path) -> None:
    db = tmp_path / "central.db"
    clock = FakeClock(T0)
    with central(f"sqlite:///{db}", tmp_path, clock, busy_timeout_seconds=5) as server:
        token = server.token()
        other = sqlite3.connect(db, isolation_level=None, timeout=5, check_same_thread=False)
        other.execute("BEGIN EXCLUSIVE")
        release = threading.Timer(0.5, lambda: other.execute("COMMIT"))
        release.start()
        try:
            response = push_directly(server, token, 0)
        finally:
            release.join()
            other.close()
        stored = server.stored()
    assert response.status_code == 200
    assert response.json()["results"] == ["accepted"]
    assert list(stored.values()) == [1]
    assert integrity(db) == "ok"
