"""Alertmanager hears of a resolution (and of a new alert) at the evaluation that decided it.

Its firing alerts are pushed again every minute, as Prometheus re-sends them; a
resolution used to ride on that re-push, so Alertmanager listed an alert as active up to
a minute after the other receivers were told it had resolved. Prometheus sends a
resolved alert at the next evaluation, and gpuwatch now does too.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from server.conftest import (  # noqa: F401 (fixtures)
    database,
    database_url,
    migrated_sqlite,
    postgres_url,
    sqlite_url,
)
from server.factories import T0, gpu, process, snapshot
from server.harness import make_token
from sqlalchemy import text
from support.clock import FakeClock

from gpuwatch.server.alerts import dispatch, lifecycle, rules
from gpuwatch.server.alerts.config import AlertSettings
from gpuwatch.server.alerts.engine import AlertEngine
from gpuwatch.server.database import Database
from gpuwatch.server.ingest.service import ingest_snapshots
from gpuwatch.server.notifications.config import ReceiverConfig
from gpuwatch.server.notifications.receivers.base import build_receiver
from gpuwatch.settings import ServerSettings
from gpuwatch.wire import IngestRequest

AM = dispatch.ReceiverInfo("am", True, dispatch.ALERTMANAGER_RESEND_SECONDS)


def _firing(rule: str, at: float) -> lifecycle.AlertState:
    candidate = rules.Candidate(rule, "critical", {"rule": rule, "hostname": "h"}, rule)
    (alert,) = lifecycle.advance({}, [candidate], AlertSettings(), now=at)
    return alert


def _pushes(timeline: dict[float, list[lifecycle.AlertState]]) -> list[tuple[float, list[str]]]:
    """Plan every 15 s over ``timeline`` (the alerts as of each time); what was pushed."""
    config = AlertSettings()
    groups: dict[tuple[str, str], dispatch.GroupState] = {}
    pushed = []
    alerts: list[lifecycle.AlertState] = []
    for t in range(0, 181, 15):
        alerts = timeline.get(T0 + t, alerts)
        result = dispatch.plan(alerts, groups, [], [AM], config, now=T0 + t)
        for group in result.groups:
            groups[(group.receiver, group.group_key)] = group
        for notification, _ in result.notifications:
            pushed.append((float(t), [f"{a.rule}:{a.status}" for a in notification.alerts]))
    return pushed


def test_a_resolution_is_pushed_at_once_and_firing_alerts_every_minute() -> None:
    lost = _firing("gpu_lost", T0)
    resolved = lifecycle.AlertState(**{**vars(lost), "state": "resolved", "resolved_at": T0 + 75})
    assert _pushes({T0: [lost], T0 + 75: [resolved]}) == [
        (0.0, ["gpu_lost:firing"]),
        (60.0, ["gpu_lost:firing"]),
        (75.0, ["gpu_lost:resolved"]),  # not at 120 s
    ]


def test_a_new_alert_of_a_group_is_pushed_at_once() -> None:
    lost = _firing("gpu_lost", T0)
    same_group = dispatch.group_of(lost.labels, AlertSettings().group_by)[0]
    ecc = _firing("gpu_lost", T0 + 30)
    ecc = lifecycle.AlertState(**{**vars(ecc), "labels": {**ecc.labels, "gpu": "1"}})
    ecc = lifecycle.AlertState(**{**vars(ecc), "fingerprint": rules.fingerprint(ecc.labels)})
    assert dispatch.group_of(ecc.labels, AlertSettings().group_by)[0] == same_group
    pushed = _pushes({T0: [lost], T0 + 30: [lost, ecc]})
    assert [t for t, _ in pushed] == [0.0, 30.0, 90.0, 150.0]


# -- the engine, a real ingest and a real HTTP endpoint answering as Alertmanager -----


@pytest.fixture
def settings(tmp_path: Any, database_url: str) -> ServerSettings:  # noqa: F811
    return ServerSettings.model_validate(
        {
            "data_dir": tmp_path,
            "database_url": database_url,
            "scheduler": False,
            "agent_push_interval_seconds": 15,
        }
    )


def _push(db: Database, settings: ServerSettings, sequence: int, ecc: int) -> float:
    at = T0 + sequence * 15
    snap = snapshot(sequence, [gpu(0, [process(7)], ecc_uncorrected_volatile=ecc)], at=at)
    with db.writer() as session, session.begin():
        host_id = session.scalar(text("SELECT id FROM hosts WHERE hostname = 'host-1'"))
        ingest_snapshots(
            session=session,
            dialect=db.dialect,
            host_id=host_id,
            request=IngestRequest(snapshots=[snap]),
            settings=settings,
            now=at,
        )
    return at


def test_alertmanager_is_told_of_a_resolution_at_the_evaluation_that_decided_it(
    database: Database,  # noqa: F811
    settings: ServerSettings,
    receiver_server: Any,
) -> None:
    clock = FakeClock(T0)
    make_token(database, "host-1")
    with httpx.Client(trust_env=False) as client:
        config = ReceiverConfig(name="am", type="alertmanager", url=receiver_server.url())
        receiver = build_receiver(config, client=client, clock=clock)
        engine = AlertEngine(receivers={"am": receiver}, clock=clock, sleep=clock.advance)
        told: list[tuple[float, list[bool]]] = []
        for sequence in range(1, 11):
            # ECC errors for the first 6 pushes (an alert with no for, no keep_firing_for).
            at = _push(database, settings, sequence, ecc=2 if sequence <= 6 else 0)
            clock.now = at
            before = len(receiver_server.received)
            engine.run(database=database, settings=settings, now=at)
            for request in receiver_server.received[before:]:
                told.append((at, ["endsAt" in a for a in json.loads(request.body)]))
    fired, cleared = T0 + 15, T0 + 7 * 15  # the minute's re-push would come at T0 + 135
    assert told == [(fired, [False]), (fired + 60, [False]), (cleared, [True])]
