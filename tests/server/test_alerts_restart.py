"""A server restart after an outage: the alerts still firing keep their episode.

While the server was down its agents spooled, and its first evaluation after the restart
came before their first push: every host looked silent, its figures stale, and each
alert on them resolved (a ``resolved`` notification) then fired again as a new episode
when the agent's push arrived. A host's silence is now counted from when the server
started at the earliest, as ``agent_silent`` counts it. Real ingest into SQLite, the real
engine, a fake clock, on both databases.
"""

from __future__ import annotations

import pytest
from sqlalchemy import text
from support.clock import FakeClock

from gpuwatch.server.alerts.engine import AlertEngine
from gpuwatch.server.database import Database
from gpuwatch.server.ingest.service import ingest_snapshots
from gpuwatch.settings import ServerSettings
from gpuwatch.wire import IngestRequest
from server.factories import T0, gpu, process, snapshot
from server.harness import make_token


def _push(database: Database, settings: ServerSettings, sequence: int, at: float) -> None:
    """host-1 with uncorrected ECC errors on GPU 0 (the gpu_ecc_uncorrected alert)."""
    gpus = [gpu(0, [process(7)], ecc_uncorrected_volatile=2), gpu(1, [process(8)])]
    with database.writer() as session, session.begin():
        host_id = session.scalar(text("SELECT id FROM hosts WHERE hostname = 'host-1'"))
        ingest_snapshots(
            session=session,
            dialect=database.dialect,
            host_id=host_id,
            request=IngestRequest(snapshots=[snapshot(sequence, gpus, at=at)]),
            settings=settings,
            now=at,
        )


def _episodes(database: Database) -> list[tuple[str, float, float | None]]:
    with database.reader() as session:
        rows = session.execute(
            text(
                "SELECT rule, fired_at, resolved_at FROM alerts WHERE rule = 'gpu_ecc_uncorrected'"
            )
        ).all()
    return [(r.rule, r.fired_at, r.resolved_at) for r in rows]


@pytest.mark.parametrize("outage", [180.0, 720.0])
def test_an_alert_firing_before_an_outage_keeps_its_episode_after_the_restart(
    database: Database, settings: ServerSettings, outage: float
) -> None:
    clock = FakeClock(T0)
    make_token(database, "host-1", now=T0)
    engine = AlertEngine(receivers={}, clock=clock, sleep=clock.advance)
    sequence, at = 0, T0
    while at <= T0 + 600:
        sequence += 1
        _push(database, settings, sequence, at)
        engine.run(database=database, settings=settings, now=at)
        at += 15
    [(_, fired_at, resolved_at)] = _episodes(database)
    assert resolved_at is None

    restarted = at + outage
    engine = AlertEngine(receivers={}, clock=clock, sleep=clock.advance)  # nothing in memory
    at = restarted + 15  # the alert job's first run; the agent's first push 40 s in
    while at <= restarted + 600:
        if at >= restarted + 40:
            sequence += 1
            _push(database, settings, sequence, at)
        engine.run(database=database, settings=settings, now=at, up_since=restarted)
        at += 15
    assert _episodes(database) == [("gpu_ecc_uncorrected", fired_at, None)]
