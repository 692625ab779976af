"""Scheduled jobs, called directly with an injected time, and their runner's guard and lock."""

from __future__ import annotations

import time
from typing import Any

import pytest
from sqlalchemy import event, func, select, text

from gpuwatch.server.app import create_app
from gpuwatch.server.database import Database, create_database
from gpuwatch.server.database.core import advisory_lock_key
from gpuwatch.server.database.migrate import upgrade
from gpuwatch.server.events.models import Event
from gpuwatch.server.hosts.models import GpuSample
from gpuwatch.server.ingest.service import ingest_snapshots
from gpuwatch.server.jobs import (
    STALE_LIFETIME_SECONDS,
    close_stale_lifetimes,
    detect_silent_agents,
    purge_expired,
)
from gpuwatch.server.metrics import ServerStats
from gpuwatch.server.processes.models import ProcessLifetime, ProcessSample
from gpuwatch.server.scheduler import JobSpec, job_specs, run_job
from gpuwatch.settings import ServerSettings
from gpuwatch.snapshot import HostSnapshot
from gpuwatch.wire import IngestRequest
from server.factories import T0, gpu, process, snapshot
from server.harness import FakeClock, make_token, serve

DAY = 86400.0


def ingest(database: Database, settings: ServerSettings, *snaps: HostSnapshot) -> None:
    host = snaps[0].hostname
    if not _host_exists(database, host):
        make_token(database, host)
    with database.writer() as session, session.begin():
        host_id = session.scalar(text("SELECT id FROM hosts WHERE hostname = :h"), {"h": host})
        ingest_snapshots(
            session=session,
            dialect=database.dialect,
            host_id=host_id,
            request=IngestRequest(snapshots=list(snaps)),
            settings=settings,
            now=max(s.collected_at for s in snaps),
        )


def _host_exists(database: Database, hostname: str) -> bool:
    with database.reader() as session:
        found = session.scalar(text("SELECT 1 FROM hosts WHERE hostname = :h"), {"h": hostname})
    return found is not None


def count(database: Database, model: Any, *where: Any) -> int:
    with database.reader() as session:
        return session.scalar(select(func.count()).select_from(model).where(*where)) or 0


def test_retention_deletes_what_is_older_than_retention_and_keeps_the_rest(
    database: Database, settings: ServerSettings
) -> None:
    settings = settings.model_copy(update={"retention_days": 1.0})
    # Day 0: a process that comes and goes (closed lifetime, samples, an orphan event).
    old = [snapshot(seq, [gpu(0, [process(1, orphaned=True)])]) for seq in range(10)]
    old.append(snapshot(10, [gpu(0, [])]))
    # Day 2: a process still running.
    new = [
        snapshot(seq, [gpu(0, [process(2)])], at=T0 + 2 * DAY + seq * 15) for seq in range(11, 21)
    ]
    ingest(database, settings, *old)
    ingest(database, settings, *new)
    assert count(database, ProcessSample, ProcessSample.t < T0 + DAY) > 0

    deleted = purge_expired(database=database, settings=settings, now=T0 + 2 * DAY + 400)

    assert deleted["process_lifetimes"] == 1 and deleted["events"] == 1
    assert count(database, ProcessSample, ProcessSample.t < T0 + DAY) == 0
    assert count(database, GpuSample, GpuSample.t < T0 + DAY) == 0
    assert count(database, ProcessSample) > 0  # day 2's samples stay
    assert count(database, ProcessLifetime) == 1
    # Idempotent: nothing more to delete.
    again = purge_expired(database=database, settings=settings, now=T0 + 2 * DAY + 400)
    assert not any(again.values())


def test_retention_deletes_in_batches(
    database: Database, settings: ServerSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    snaps = [snapshot(seq, [gpu(0, [process(1)])], interval=60) for seq in range(12)]
    ingest(database, settings, *snaps)
    monkeypatch.setattr("gpuwatch.server.jobs.RETENTION_BATCH", 3)

    deleted = purge_expired(database=database, settings=settings, now=T0 + 40 * DAY)

    assert deleted["process_samples"] == 11 and deleted["gpu_samples"] == 11
    assert count(database, ProcessSample) == 0


def test_agent_silent_opens_one_event_and_a_new_snapshot_closes_it(
    database: Database, settings: ServerSettings
) -> None:
    ingest(database, settings, snapshot(0, [gpu(0)]))
    threshold = settings.agent_silent_intervals * settings.agent_push_interval_seconds

    assert detect_silent_agents(database=database, settings=settings, now=T0 + threshold) == 0
    assert detect_silent_agents(database=database, settings=settings, now=T0 + 100) == 1
    assert detect_silent_agents(database=database, settings=settings, now=T0 + 200) == 0

    with database.reader() as session:
        (event,) = session.scalars(select(Event).where(Event.kind == "agent_silent")).all()
    assert event.started_at == T0 + threshold
    assert event.last_seen_at == T0 + 200 and event.ended_at is None

    ingest(database, settings, snapshot(1, [gpu(0)], at=T0 + 300))

    assert count(database, Event, Event.kind == "agent_silent", Event.ended_at.is_(None)) == 0


def test_silent_hosts_are_written_a_batch_at_a_time_and_refreshed_once_per_threshold(
    database: Database, settings: ServerSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("gpuwatch.server.jobs.SILENT_BATCH", 2)
    for n in range(5):
        ingest(database, settings, snapshot(0, [gpu(0)], hostname=f"host-{n}"))
    threshold = settings.agent_silent_intervals * settings.agent_push_interval_seconds
    writes: list[int] = []
    event.listen(database.engine, "commit", lambda _conn: writes.append(1))

    assert detect_silent_agents(database=database, settings=settings, now=T0 + 100) == 5
    assert len(writes) == 3  # 5 hosts, 2 to a transaction
    # Within a threshold of the last refresh: nothing to write.
    writes.clear()
    assert (
        detect_silent_agents(database=database, settings=settings, now=T0 + 100 + threshold / 2)
        == 0
    )
    assert writes == []
    assert _silent_seen(database) == [T0 + 100] * 5
    # A threshold later: refreshed, still one event each.
    assert detect_silent_agents(database=database, settings=settings, now=T0 + 101 + threshold) == 0
    assert _silent_seen(database) == [T0 + 101 + threshold] * 5


def _silent_seen(database: Database) -> list[float]:
    with database.reader() as session:
        return list(
            session.scalars(
                select(Event.last_seen_at)
                .where(Event.kind == "agent_silent", Event.ended_at.is_(None))
                .order_by(Event.host_id)
            )
        )


def test_hosts_that_never_reported_are_not_called_silent(
    database: Database, settings: ServerSettings
) -> None:
    make_token(database, "fresh-host")

    assert detect_silent_agents(database=database, settings=settings, now=T0 + DAY) == 0


def test_stale_lifetimes_of_a_silent_host_are_closed_at_their_last_sighting(
    database: Database, settings: ServerSettings
) -> None:
    snaps = [snapshot(seq, [gpu(0, [process(1, orphaned=True), process(2)])]) for seq in range(3)]
    ingest(database, settings, *snaps)

    assert close_stale_lifetimes(database=database, settings=settings, now=T0 + 60) == 0
    assert close_stale_lifetimes(database=database, settings=settings, now=T0 + 600) == 2

    with database.reader() as session:
        ended = session.scalars(select(ProcessLifetime.ended_at)).all()
        orphan = session.scalars(select(Event).where(Event.kind == "orphaned")).one()
    assert ended == [snaps[-1].collected_at] * 2
    assert orphan.ended_at == snaps[-1].collected_at
    assert close_stale_lifetimes(database=database, settings=settings, now=T0 + 900) == 0


def test_a_failing_job_is_contained_and_counted(
    database: Database, settings: ServerSettings, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(**_: Any) -> None:
        raise RuntimeError("boom")

    stats = ServerStats()

    result = run_job(
        JobSpec("broken", broken, 60),
        database=database,
        settings=settings,
        clock=lambda: T0,
        stats=stats,
    )

    assert result == "failed"
    assert stats.job_runs[("broken", "failed")] == 1
    assert "job broken failed" in caplog.text


def test_jobs_run_through_the_runner(database: Database, settings: ServerSettings) -> None:
    stats = ServerStats()
    for spec in job_specs(settings):
        assert (
            run_job(spec, database=database, settings=settings, clock=lambda: T0, stats=stats)
            == "ok"
        )


@pytest.mark.postgres
def test_a_job_another_replica_is_running_is_skipped(postgres_url: str) -> None:
    settings = ServerSettings(database_url=postgres_url, scheduler=False)
    database = create_database(postgres_url)
    upgrade(database)
    ran: list[float] = []
    spec = JobSpec("agent_silent", lambda **kw: ran.append(kw["now"]), 15)
    stats = ServerStats()
    with database.engine.connect() as other_replica:
        schema = other_replica.scalar(text("SELECT current_schema()"))
        assert schema != "public"  # the fixture's own schema: a second installation
        held = advisory_lock_key(f"job:{schema}:agent_silent")
        other_replica.execute(text("SELECT pg_advisory_lock(:k)"), {"k": held})
        assert (
            run_job(spec, database=database, settings=settings, clock=lambda: T0, stats=stats)
            == "skipped"
        )
        other_replica.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": held})
        # The same job of an installation in the default schema (another test's server,
        # or another team's gpuwatch in the same database) does not hold this one back.
        elsewhere = advisory_lock_key("job:agent_silent")
        other_replica.execute(text("SELECT pg_advisory_lock(:k)"), {"k": elsewhere})
        assert (
            run_job(spec, database=database, settings=settings, clock=lambda: T0, stats=stats)
            == "ok"
        )
        other_replica.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": elsewhere})
    assert ran == [T0]
    database.dispose()


def test_the_app_runs_the_jobs_on_its_scheduler(
    database: Database, settings: ServerSettings, clock: FakeClock
) -> None:
    # A 0.1 s push interval makes the agent_silent job run every 0.1 s.
    settings = settings.model_copy(update={"scheduler": True, "agent_push_interval_seconds": 0.1})
    ingest(database, settings, snapshot(0, [gpu(0)]))
    clock.now = T0 + 60
    app = create_app(settings, clock=clock, engine=database.engine)

    with serve(app):
        deadline = time.monotonic() + 10
        while count(database, Event, Event.kind == "agent_silent") == 0:
            assert time.monotonic() < deadline, "the scheduler never ran agent_silent"
            clock.now += 1  # the server judges silence only once up for the threshold
            time.sleep(0.05)


def test_no_host_is_silent_until_the_server_has_been_up_for_the_threshold(
    database: Database, settings: ServerSettings
) -> None:
    # The server was down for an hour (agents spooled); it starts again at T0 + 3600.
    # Its first runs must not call every host silent for the server's own outage.
    ingest(database, settings, snapshot(0, [gpu(0)]))
    threshold = settings.agent_silent_intervals * settings.agent_push_interval_seconds
    up = T0 + 3600
    for now in (up, up + threshold / 2, up + threshold - 1):
        assert detect_silent_agents(database=database, settings=settings, now=now, up_since=up) == 0
    # Up long enough, and still nothing from the host: now it is silent.
    assert (
        detect_silent_agents(
            database=database, settings=settings, now=up + threshold + 1, up_since=up
        )
        == 1
    )


def test_lifetimes_are_not_ended_until_the_server_has_been_up_for_the_threshold(
    database: Database, settings: ServerSettings
) -> None:
    ingest(database, settings, snapshot(0, [gpu(0, [process(7)])]))
    up = T0 + 3600  # back after an hour down: the host's silence is the server's own
    assert close_stale_lifetimes(database=database, settings=settings, now=up, up_since=up) == 0
    assert (
        close_stale_lifetimes(
            database=database, settings=settings, now=up + STALE_LIFETIME_SECONDS + 1, up_since=up
        )
        == 1
    )


def test_a_network_blip_shorter_than_five_minutes_keeps_the_lifetimes(
    database: Database, settings: ServerSettings
) -> None:
    # The agent spools through 150 s without the server and replays every poll: the
    # host's lifetimes (and their events) must still be open when it does.
    ingest(database, settings, snapshot(0, [gpu(0, [process(7)])]))
    assert close_stale_lifetimes(database=database, settings=settings, now=T0 + 150) == 0
    assert close_stale_lifetimes(database=database, settings=settings, now=T0 + 301) == 1
