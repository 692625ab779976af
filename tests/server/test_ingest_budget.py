"""Every push is answered within its time budget: 200 (whole or partial) or 503.

Over real HTTP to the real app, on SQLite and Postgres. The budget runs on an injected
monotonic clock, so nothing here sleeps for a budget to expire: either a
:class:`TickingClock` that moves one second each time the server reads it (the budget
then runs out after a fixed number of reads, partway through a batch), or the shared
fake clock, advanced by the test while the request waits for SQLite's write turn.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from prometheus_client.parser import text_string_to_metric_families
from pydantic import SecretStr
from sqlalchemy import select
from support.clock import FakeClock as MonotonicClock

from gpuwatch.agent.reporter import DEFERRED_PAUSE_SECONDS, Reporter
from gpuwatch.server.app import create_app
from gpuwatch.server.database import Database
from gpuwatch.server.ingest.models import SnapshotSeen
from gpuwatch.settings import AgentSettings, ServerSettings
from gpuwatch.snapshot import HostSnapshot
from gpuwatch.wire import PARTIAL_DEFERRED, PARTIAL_HEADER
from server.factories import body, gpu, process, snapshot
from server.harness import FakeClock, Live, serve

BUDGET_SECONDS = 5.0
PARTIAL = {PARTIAL_HEADER: PARTIAL_DEFERRED}


class TickingClock:
    """Monotonic seconds that move ``tick`` each time they are read, from the read after
    the first ``still_reads`` (which all read 0)."""

    def __init__(self, tick: float, *, still_reads: int = 1) -> None:
        self.tick = tick
        self.still_reads = still_reads
        self.reads = 0

    def __call__(self) -> float:
        self.reads += 1
        return self.tick * max(0, self.reads - self.still_reads)


@pytest.fixture
def budget_settings(settings: ServerSettings) -> ServerSettings:
    return settings.model_copy(update={"ingest_time_budget_seconds": BUDGET_SECONDS})


@contextmanager
def _live(
    settings: ServerSettings, database: Database, clock: FakeClock, monotonic: Any
) -> Iterator[Live]:
    app: FastAPI = create_app(settings, clock=clock, engine=database.engine, monotonic=monotonic)
    with serve(app) as url, httpx.Client(base_url=url, timeout=30) as client:
        yield Live(url=url, client=client, database=database, clock=clock)


@pytest.fixture
def ticking(
    budget_settings: ServerSettings, database: Database, clock: FakeClock
) -> Iterator[Live]:
    """A server whose budget runs out at the fifth read of its clock: the handler's
    start, the worker thread's start and the write turn take three, so a batch gets
    through some snapshots and not all."""
    with _live(budget_settings, database, clock, TickingClock(1.0)) as live:
        yield live


def _push(live: Live, token: str, snaps: list[HostSnapshot], **headers: str) -> httpx.Response:
    live.clock.now = max(live.clock.now, max(s.collected_at for s in snaps))
    return live.client.post(
        "/api/v1/snapshots",
        json=body(*snaps, spool_dropped_total=3),
        headers={"Authorization": f"Bearer {token}", **headers},
    )


def _history(hostname: str) -> list[HostSnapshot]:
    """Processes come and go, so the order and the cut of a batch change the state."""
    snaps = []
    for seq in range(8):
        procs = [process(100, used_gib=2 + seq)] if seq < 5 else []
        if seq >= 3:
            procs.append(process(200, user="bob"))
        snaps.append(snapshot(seq, [gpu(0, procs), gpu(1)], hostname=hostname))
    return snaps


def _seen(live: Live, hostname: str | None = None) -> list[int]:
    with live.database.reader() as session:
        query = select(SnapshotSeen.sequence).order_by(SnapshotSeen.sequence)
        if hostname is not None:
            query = query.where(SnapshotSeen.agent_id == f"agent-{hostname}")
        return list(session.scalars(query))


def _counters(live: Live) -> dict[tuple[str, str], float]:
    text = live.client.get("/metrics").text
    return {
        (sample.name, sample.labels.get("result", "")): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name.startswith("gpuwatch_server_ingest_")
    }


def _state(live: Live, hostname: str) -> dict[str, Any]:
    """What the read API says of a host, less what names it or its row ids."""
    host = live.client.get(f"/api/v1/hosts/{hostname}").json()
    processes = live.client.get("/api/v1/processes", params={"host": hostname}).json()["items"]
    return _anonymous({"host": host, "processes": sorted(processes, key=lambda p: p["pid"])})


def _anonymous(value: Any) -> Any:
    if isinstance(value, dict):
        names = ("id", "hostname", "agent_id")
        return {k: _anonymous(v) for k, v in value.items() if k not in names}
    if isinstance(value, list):
        return [_anonymous(v) for v in value]
    return value


def test_a_batch_out_of_time_stores_a_prefix_and_defers_the_rest(ticking: Live) -> None:
    live = ticking
    token = live.token("host-1")
    snaps = _history("host-1")

    response = _push(live, token, snaps, **PARTIAL)

    assert response.status_code == 200, response.text
    results = response.json()["results"]
    k = results.count("accepted")
    assert 1 <= k < len(snaps)
    assert results == ["accepted"] * k + ["deferred"] * (len(snaps) - k)
    assert response.json()["accepted"] == k and response.json()["duplicate"] == 0
    assert _seen(live) == list(range(k))  # nothing of the deferred ones is stored
    host = live.client.get("/api/v1/hosts/host-1").json()
    assert host["last_seen_at"] == snaps[k - 1].collected_at
    assert host["spool_dropped_total"] == 3
    counters = _counters(live)
    assert counters[("gpuwatch_server_ingest_requests_total", "partial")] == 1
    assert counters[("gpuwatch_server_ingest_requests_total", "ok")] == 0
    assert counters[("gpuwatch_server_ingest_snapshots_total", "accepted")] == k
    assert counters[("gpuwatch_server_ingest_snapshots_total", "deferred")] == len(snaps) - k


def test_resending_the_deferred_ones_ends_as_if_the_batch_was_stored_whole(
    ticking: Live,
) -> None:
    live = ticking
    token = live.token("host-1")
    rest = _history("host-1")
    answers: list[list[str]] = []
    while rest:
        response = _push(live, token, rest, **PARTIAL)
        assert response.status_code == 200, response.text
        results = response.json()["results"]
        answers.append(results)
        rest = [s for s, result in zip(rest, results, strict=True) if result == "deferred"]
        assert len(answers) <= 8  # each request stores at least one
    assert len(answers) > 1
    assert all("duplicate" not in results for results in answers)
    assert _seen(live) == list(range(8))

    # The same snapshots of another host, sent whole (no header: never partial).
    other = live.token("host-2")
    whole = _push(live, other, _history("host-2"))
    assert whole.json()["results"] == ["accepted"] * 8
    assert _state(live, "host-1") == _state(live, "host-2")


def test_without_the_header_a_batch_is_never_partial(ticking: Live) -> None:
    live = ticking
    token = live.token("host-1")
    snaps = _history("host-1")

    response = _push(live, token, snaps)

    assert response.status_code == 200, response.text
    assert response.json()["results"] == ["accepted"] * len(snaps)
    assert _seen(live) == list(range(len(snaps)))
    counters = _counters(live)
    assert counters[("gpuwatch_server_ingest_requests_total", "partial")] == 0
    assert counters[("gpuwatch_server_ingest_snapshots_total", "deferred")] == 0


def test_a_repeat_of_a_deferred_snapshot_in_the_batch_is_deferred_with_it(
    ticking: Live,
) -> None:
    live = ticking
    token = live.token("host-1")
    snaps = _history("host-1")
    batch = [*snaps, snaps[-1]]  # the last one twice

    results = _push(live, token, batch, **PARTIAL).json()["results"]

    k = results.count("accepted")
    assert results == ["accepted"] * k + ["deferred"] * (len(batch) - k)
    assert _seen(live) == list(range(k))


@pytest.mark.parametrize("tick", [10.0, 3.0], ids=["before-parsing", "at-the-write-turn"])
def test_a_budget_spent_before_the_batch_starts_is_503_and_stores_nothing(
    budget_settings: ServerSettings, database: Database, clock: FakeClock, tick: float
) -> None:
    # The clock stands still for the deadline's start and the body's read (a spent
    # budget there is a slow body, 503 with Retry-After 1, and whether the body's bytes
    # were buffered by then was up to the machine's load: a flake). Then a tick of 10 s
    # spends the budget by the time a worker thread takes the request; one of 3 s by
    # the time it gets its write turn (the fourth read, at 6 s).
    with _live(budget_settings, database, clock, TickingClock(tick, still_reads=2)) as live:
        token = live.token("host-1")

        response = _push(live, token, _history("host-1"), **PARTIAL)

        assert response.status_code == 503, response.text
        assert response.headers["Retry-After"] == "5"
        assert _seen(live) == []
        counters = _counters(live)
        assert counters[("gpuwatch_server_ingest_requests_total", "over_budget")] == 1
        assert counters[("gpuwatch_server_ingest_requests_total", "unavailable")] == 0


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_a_push_that_waited_its_budget_for_the_write_turn_is_503(
    budget_settings: ServerSettings, database: Database, clock: FakeClock
) -> None:
    """The reconnect storm's case: admitted, then queued behind other writers."""
    monotonic = MonotonicClock()
    with _live(budget_settings, database, clock, monotonic) as live:
        token = live.token("host-1")
        turns = database.write_turns
        assert turns is not None
        answer: list[httpx.Response] = []
        with database.writer():  # another writer holds the turn
            pusher = threading.Thread(
                target=lambda: answer.append(_push(live, token, _history("host-1"), **PARTIAL))
            )
            pusher.start()
            deadline = time.monotonic() + 10
            while turns.waiting == 0:  # the push is queued behind us
                assert time.monotonic() < deadline, "the push never queued for the turn"
                time.sleep(0.005)
            monotonic.advance(BUDGET_SECONDS)
        pusher.join(timeout=30)

        (response,) = answer
        assert response.status_code == 503, response.text
        assert response.headers["Retry-After"] == "5"
        assert _seen(live) == []
        assert _counters(live)[("gpuwatch_server_ingest_requests_total", "over_budget")] == 1
        # The agent's retry, not queued, is stored whole.
        retry = _push(live, token, _history("host-1"), **PARTIAL)
        assert retry.json()["results"] == ["accepted"] * 8


def test_the_reporter_keeps_the_deferred_ones_and_delivers_them_next(
    ticking: Live, tmp_path: Path
) -> None:
    live = ticking
    settings = AgentSettings(
        server_url=live.url,
        token=SecretStr(live.token("host-1")),
        spool_dir=tmp_path / "spool",
        push_interval_seconds=15,
    )
    agent_clock = MonotonicClock()
    snaps = _history("host-1")
    live.clock.now = snaps[-1].collected_at
    reporter = Reporter(settings, clock=agent_clock, rand=lambda: 0.5)
    try:
        for snap in snaps:
            reporter.offer(snap)

        first = reporter.drain_once()
        assert first.stopped_by == "deferred"
        assert 1 <= first.delivered < len(snaps) and first.dropped == 0
        assert first.pending == len(snaps) - first.delivered
        # Oldest first: what was stored is the start of the spool.
        assert _seen(live) == list(range(first.delivered))
        # A pause, not a failure: nothing is sent before it ends, and it does not grow.
        assert first.retry_in_seconds is not None
        assert first.retry_in_seconds <= DEFERRED_PAUSE_SECONDS
        assert reporter.drain_once().stopped_by == "backoff"
        assert reporter.stats().consecutive_failures == 0

        drains = [first]
        while drains[-1].stopped_by is not None:
            assert len(drains) <= len(snaps)
            agent_clock.advance(DEFERRED_PAUSE_SECONDS)
            drains.append(reporter.drain_once())
            assert drains[-1].stopped_by in ("deferred", None)
        stats = reporter.stats()
    finally:
        reporter.close()

    assert sum(d.delivered for d in drains) + sum(d.dropped for d in drains) == len(snaps)
    assert stats.pending == 0 and stats.dropped_total == {}
    assert stats.pushed_total == {"accepted": len(snaps), "duplicate": 0}
    assert stats.batches_total == {"partial": len(drains) - 1, "success": 1}
    assert _seen(live) == list(range(len(snaps)))  # each stored once
