"""Reads cannot starve ingest of database connections (database/core.py, "connection
slots"): read sessions hold at most READ_CONNECTIONS of the pool, so a push still gets
one at once, and a read past them waits at most READ_WAIT_SECONDS for a slot, then is
answered 503 with Retry-After. Before, readers could take every pooled connection and
a push waited the pool's 30 s checkout timeout, far past its 5 s budget."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
from sqlalchemy import text

from gpuwatch.server.database import core
from server.factories import body, gpu, process, snapshot
from server.harness import Live


@pytest.fixture
def token(live: Live) -> str:
    return live.token("host-1")


@pytest.fixture
def readers_holding_every_connection(
    live: Live, token: str, monkeypatch: pytest.MonkeyPatch
) -> Iterator[int]:
    """As many readers as the pool has connections, each holding one (a slow read) until
    the test ends; yields how many got one."""
    monkeypatch.setattr(core, "READ_WAIT_SECONDS", 0.3)
    release = threading.Event()
    held: list[int] = []
    lock = threading.Lock()

    def read() -> None:
        try:
            with live.database.reader() as session:
                session.execute(text("SELECT 1"))  # checks a connection out
                with lock:
                    held.append(1)
                release.wait(20)
        except core.SlotTimeout:
            pass

    capacity = core.READ_CONNECTIONS + core.WRITE_CONNECTIONS
    threads = [threading.Thread(target=read, daemon=True) for _ in range(capacity)]
    for thread in threads:
        thread.start()
    time.sleep(0.6)  # the ones without a slot have given up
    yield len(held)
    release.set()
    for thread in threads:
        thread.join(10)


def test_reads_cannot_take_the_connections_a_push_needs(
    live: Live, token: str, readers_holding_every_connection: int
) -> None:
    assert readers_holding_every_connection == core.READ_CONNECTIONS

    began = time.monotonic()
    response = live.push(token, body(snapshot(1, [gpu(0, [process(100)])])))

    assert response.status_code == 200, response.text
    assert time.monotonic() - began < live_budget(live)


def test_a_read_past_the_slots_is_503_with_retry_after(
    live: Live, readers_holding_every_connection: int
) -> None:
    began = time.monotonic()
    response = live.client.get("/api/v1/processes", params={"limit": 1000})

    assert response.status_code == 503
    assert response.headers["retry-after"]
    assert time.monotonic() - began < 5


def live_budget(live: Live) -> float:
    return 5.0  # ingest_time_budget_seconds' default, which the live app uses
