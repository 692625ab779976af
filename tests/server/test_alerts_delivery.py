"""Delivery of planned notifications: order per group, Alertmanager batches, deadlines,
and the spacing of sends to one endpoint.

The real engine on SQLite and Postgres; receivers post through an ``httpx.MockTransport``
that scripts the answers. Alerts are written as rows (rules that stay firing for a day),
and time is injected: nothing sleeps.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from sqlalchemy import func, insert, select, update

from gpuwatch.server.alerts.engine import BATCH_ALERTS, AlertEngine
from gpuwatch.server.alerts.models import AlertRow, NotificationRow
from gpuwatch.server.alerts.rules import fingerprint
from gpuwatch.server.alerts.service import receiver_states
from gpuwatch.server.database import Database
from gpuwatch.server.notifications.config import ReceiverConfig
from gpuwatch.server.notifications.receivers.base import Receiver, build_receiver
from gpuwatch.settings import ServerSettings
from server.factories import T0
from server.harness import FakeClock

Handler = Callable[[httpx.Request], httpx.Response]


@pytest.fixture
def delivery_settings(tmp_path: Any, database_url: str) -> ServerSettings:
    return ServerSettings.model_validate(
        {
            "data_dir": tmp_path,
            "database_url": database_url,
            "scheduler": False,
            "alerts": {
                "group_wait": "0s",
                "group_interval": "1s",
                "repeat_interval": "1h",
                "external_url": "https://gpuwatch.example.org/",
                # Alerts written as rows stay firing without facts for a day.
                "rules": {
                    "gpu_throttled": {"keep_firing_for": "1d"},
                    "gpu_memory_repair": {"keep_firing_for": "1d"},
                },
            },
        }
    )


class Recorder:
    """A mock transport: answers with ``script`` (then 200) and keeps what was posted."""

    def __init__(self, *script: httpx.Response) -> None:
        self.script = list(script)
        self.posts: list[tuple[str, Any]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.posts.append((str(request.url), json.loads(request.content)))
        return self.script.pop(0) if self.script else httpx.Response(200, text="ok")


def receiver(
    kind: str, recorder: Recorder, clock: FakeClock, *, name: str = "r", url: str = ""
) -> Receiver:
    config = ReceiverConfig.model_validate(
        {
            "name": name,
            "type": kind,
            "url": url or f"https://{kind}.example.com/hook",
            **({"secret": "k"} if kind == "webhook" else {}),
        }
    )
    client = httpx.Client(transport=httpx.MockTransport(recorder))
    return build_receiver(config, client=client, clock=clock)


def engine_of(clock: FakeClock, *receivers: Receiver, **options: Any) -> AlertEngine:
    """An engine over ``receivers`` (each under its own name) on the fake clock, whose
    waits advance that clock."""
    options.setdefault("sleep", clock.advance)
    return AlertEngine(receivers={r.name: r for r in receivers}, clock=clock, **options)


def host(h: int, rule: str = "gpu_throttled") -> dict[str, str]:
    return {"rule": rule, "severity": "warning", "hostname": f"host-{h:03d}", "gpu": "0"}


def fire(database: Database, hosts: int, rules: tuple[str, ...] = ("gpu_throttled",)) -> None:
    rows = []
    for h in range(hosts):
        for rule in rules:
            labels = host(h, rule)
            rows.append(
                {
                    "fingerprint": fingerprint(labels),
                    "rule": rule,
                    "labels": labels,
                    "severity": "warning",
                    "state": "firing",
                    "summary": "s",
                    "description": "d",
                    "culprits": [],
                    "active_since": T0,
                    "fired_at": T0,
                    "last_true_at": T0,
                    "resolved_at": None,
                }
            )
    with database.writer() as session, session.begin():
        session.execute(insert(AlertRow), rows)


def statuses(database: Database) -> dict[str, int]:
    with database.reader() as session:
        rows = session.execute(
            select(NotificationRow.status, func.count()).group_by(NotificationRow.status)
        ).all()
    return {status: n for status, n in rows}


def test_a_retried_firing_is_never_sent_after_its_resolution(
    database: Database, delivery_settings: ServerSettings, clock: FakeClock
) -> None:
    """The audit's sequence: firing answered 503 + Retry-After 40; the alert resolves 8 s
    later. The older firing is superseded (never sent), the resolution is sent (after
    the Retry-After the receiver asked for), and nothing follows it."""
    hook = Recorder(httpx.Response(503, headers={"retry-after": "40"}))
    engine = engine_of(clock, receiver("webhook", hook, clock))
    fire(database, 1)
    engine.run(database=database, settings=delivery_settings, now=T0)
    assert [body["status"] for _, body in hook.posts] == ["firing"]

    with database.writer() as session, session.begin():
        session.execute(update(AlertRow).values(state="resolved", resolved_at=T0 + 8))
    for t in (T0 + 8, T0 + 20, T0 + 45, T0 + 60, T0 + 120):
        clock.now = t
        engine.run(database=database, settings=delivery_settings, now=t)

    assert [body["status"] for _, body in hook.posts] == ["firing", "resolved"]
    assert statuses(database) == {"superseded": 1, "sent": 1}
    with database.reader() as session:
        (state,) = receiver_states(session=session, receivers=engine.receivers)
    assert (state.status, state.pending, state.superseded) == ("ok", 0, 1)


def test_a_resolution_only_a_superseded_notification_carried_is_carried_over(
    database: Database, delivery_settings: ServerSettings, clock: FakeClock
) -> None:
    """Group of two alerts: B resolves (notified with A firing, answered 503), then C
    fires. The newer notification supersedes the older and still tells B resolved."""
    settings = delivery_settings.model_copy(
        update={
            "alerts": delivery_settings.alerts.model_copy(update={"group_by": ["rule"]}),
        }
    )
    hook = Recorder(httpx.Response(503))
    engine = engine_of(clock, receiver("webhook", hook, clock))
    fire(database, 2)
    engine.run(database=database, settings=settings, now=T0)  # A, B firing: sent (503 later)
    hook.script = [httpx.Response(503)] * 5
    with database.writer() as session, session.begin():
        session.execute(
            update(AlertRow)
            .where(AlertRow.fingerprint == fingerprint(host(1)))
            .values(state="resolved", resolved_at=T0 + 5)
        )
    clock.now = T0 + 5
    engine.evaluate(database=database, settings=settings, now=T0 + 5)  # A firing, B resolved
    fire_more = host(9)
    with database.writer() as session, session.begin():
        session.add(
            AlertRow(
                fingerprint=fingerprint(fire_more),
                rule="gpu_throttled",
                labels=fire_more,
                severity="warning",
                state="firing",
                summary="s",
                description="d",
                culprits=[],
                active_since=T0 + 6,
                fired_at=T0 + 6,
                last_true_at=T0 + 6,
            )
        )
    clock.now = T0 + 7
    engine.evaluate(database=database, settings=settings, now=T0 + 7)  # A, C firing
    hook.script = []
    clock.now = T0 + 3600
    engine.deliver(database=database, now=T0 + 3600, lease_seconds=120)

    last = hook.posts[-1][1]
    told = {a["labels"]["hostname"]: a["status"] for a in last["alerts"]}
    assert told == {"host-000": "firing", "host-001": "resolved", "host-009": "firing"}
    assert statuses(database).get("superseded") == 2


def test_alertmanager_gets_its_due_alerts_in_batches_and_keeps_up(
    database: Database, delivery_settings: ServerSettings, clock: FakeClock
) -> None:
    """600 firing groups re-pushed every minute: ceil(600 / 256) = 3 POSTs a run, no
    backlog. While Alertmanager is down, each group keeps one pending notification
    (older resends are superseded), not one more every minute."""
    am = Recorder()
    engine = engine_of(clock, receiver("alertmanager", am, clock, name="am"))
    fire(database, 300, ("gpu_throttled", "gpu_memory_repair"))
    for minute in range(3):
        clock.now = T0 + 60 * minute
        before = len(am.posts)
        engine.run(database=database, settings=delivery_settings, now=clock.now)
        posts = am.posts[before:]
        assert len(posts) == 3
        assert all(len(alerts) <= BATCH_ALERTS for _, alerts in posts)
        sent = [a for _, alerts in posts for a in alerts]
        assert len({json.dumps(a["labels"], sort_keys=True) for a in sent}) == 600
        assert all(a["generatorURL"] == "https://gpuwatch.example.org/" for a in sent)
        assert statuses(database).get("pending", 0) == 0

    am.script = [httpx.Response(503)] * 1000
    for minute in range(3, 6):
        clock.now = T0 + 60 * minute
        engine.run(database=database, settings=delivery_settings, now=clock.now)
    counts = statuses(database)
    assert counts["pending"] == 600
    assert counts["superseded"] == 1200


def test_a_notification_past_its_deadline_is_failed_without_being_sent(
    database: Database, clock: FakeClock
) -> None:
    hook = Recorder()
    engine = engine_of(clock, receiver("webhook", hook, clock))
    body: dict[str, Any] = {
        "receiver": "r",
        "group_key": "{rule='gpu_lost',hostname='h'}",
        "group_labels": {},
        "status": "firing",
        "alerts": [],
        "external_url": None,
    }
    with database.writer() as session, session.begin():
        session.add(
            NotificationRow(
                receiver="r",
                group_key=body["group_key"],
                flush_at=T0 - 7200,
                status="pending",
                body=body,
                attempts=0,
                next_attempt_at=T0 - 7200,
                deadline_at=T0 - 3600,
            )
        )
    outcomes = engine.deliver(database=database, now=T0, lease_seconds=120)

    assert hook.posts == []
    assert outcomes == [("r", "failed")]
    with database.reader() as session:
        row = session.scalars(select(NotificationRow)).one()
    assert row.status == "failed" and row.attempts == 0
    assert row.last_error is not None and "deadline passed before an attempt" in row.last_error


def test_slack_spacing_is_per_webhook_url_not_per_receiver(
    database: Database, clock: FakeClock
) -> None:
    """Two receivers on one Slack URL share its one message per second."""
    slept: list[float] = []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        clock.advance(seconds)

    hook = Recorder()
    url = "https://hooks.slack.com/services/T000/B000/XXXXXXXXXXXX"
    engine = engine_of(
        clock,
        receiver("slack", hook, clock, name="a", url=url),
        receiver("slack", hook, clock, name="b", url=url),
        receiver("slack", hook, clock, name="c", url=url + "YY"),
        sleep=sleep,
    )
    assert engine.test_receiver(database=database, name="a").outcome == "sent"
    clock.advance(0.01)
    assert engine.test_receiver(database=database, name="b").outcome == "sent"
    assert slept == [pytest.approx(0.99)]
    assert engine.test_receiver(database=database, name="c").outcome == "sent"
    assert len(slept) == 1  # another URL: not held


def test_the_test_notification_carries_the_external_url(
    database: Database, clock: FakeClock
) -> None:
    am = Recorder()
    engine = engine_of(clock, receiver("alertmanager", am, clock, name="am"))
    engine.test_receiver(database=database, name="am", external_url="https://gw.example/")
    ((_, alerts),) = am.posts
    assert alerts[0]["generatorURL"] == "https://gw.example/"
