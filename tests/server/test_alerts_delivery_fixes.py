"""Delivery under replicas, long group keys, Retry-After chains, partial refusals,
silences, send_resolved = false and scale: the second audit's findings.

The real engine on SQLite and Postgres, mock HTTP transports, an injected clock.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from sqlalchemy import event, select, update

from gpuwatch.server.alerts import dispatch
from gpuwatch.server.alerts.engine import AlertEngine
from gpuwatch.server.alerts.models import AlertGroupRow, AlertRow, NotificationRow, SilenceRow
from gpuwatch.server.alerts.rules import fingerprint
from gpuwatch.server.alerts.service import receiver_states
from gpuwatch.server.database import Database
from gpuwatch.server.notifications.config import ReceiverConfig
from gpuwatch.server.notifications.receivers.base import build_receiver
from gpuwatch.settings import ServerSettings
from server.factories import T0
from server.harness import FakeClock

# The shared fixture, imported so pytest finds it here.
from server.test_alerts_delivery import (
    Recorder,
    delivery_settings,  # noqa: F401
    engine_of,
    fire,
    host,
    receiver,
    statuses,
)


def _with(settings: ServerSettings, **alerts: Any) -> ServerSettings:
    return settings.model_copy(update={"alerts": settings.alerts.model_copy(update=alerts)})


def _resolve(database: Database, h: int, at: float) -> None:
    with database.writer() as session, session.begin():
        session.execute(
            update(AlertRow)
            .where(AlertRow.fingerprint == fingerprint(host(h)))
            .values(state="resolved", resolved_at=at)
        )


def _alert(database: Database, labels: dict[str, str], at: float = T0) -> None:
    with database.writer() as session, session.begin():
        session.add(
            AlertRow(
                fingerprint=fingerprint(labels),
                rule=labels["rule"],
                labels=labels,
                severity="warning",
                state="firing",
                summary="s",
                description="d",
                culprits=[],
                active_since=at,
                fired_at=at,
                last_true_at=at,
            )
        )


def _run(engine: AlertEngine, database: Database, settings: ServerSettings, clock: FakeClock,
         t: float) -> Any:  # fmt: skip
    clock.now = t
    return engine.run(database=database, settings=settings, now=t)


def _alertmanager_and_webhook(clock: FakeClock) -> AlertEngine:
    """An engine with an Alertmanager and a webhook receiver, each recording what it
    is sent."""
    return engine_of(
        clock,
        receiver("alertmanager", Recorder(), clock, name="am"),
        receiver("webhook", Recorder(), clock, name="hook"),
    )


def test_a_replica_without_a_receiver_leaves_its_notifications_to_the_others(
    database: Database,
    delivery_settings: ServerSettings,  # noqa: F811
    clock: FakeClock,
) -> None:
    """Rolling configuration change: replica B has receiver ``pager``, replica A not
    yet. A's run must not break B's pending page; B delivers it later. Only once its
    deadline has passed does a replica that lacks the receiver give it up."""
    old_hook, pager = Recorder(), Recorder(httpx.Response(503))
    a = engine_of(clock, receiver("webhook", old_hook, clock, name="hook"))
    b = engine_of(
        clock,
        receiver("webhook", old_hook, clock, name="hook"),
        receiver("webhook", pager, clock, name="pager", url="https://p.example/x"),
    )
    fire(database, 1)
    _run(b, database, delivery_settings, clock, T0)  # plans the page; 503
    outcomes = _run(a, database, delivery_settings, clock, T0 + 15).attempts
    assert ("pager", "broken") not in outcomes and ("pager", "failed") not in outcomes
    with database.reader() as session:
        page = session.scalars(select(NotificationRow).where(NotificationRow.receiver == "pager"))
        assert [row.status for row in page] == ["pending"]
    _run(b, database, delivery_settings, clock, T0 + 30)
    assert len(pager.posts) == 2
    assert statuses(database) == {"sent": 2}

    # A page no replica with the receiver takes in time is failed at its deadline.
    _alert(database, host(5), T0 + 60)
    pager.script = [httpx.Response(503)]
    _run(b, database, delivery_settings, clock, T0 + 60)
    deadline = T0 + 60 + delivery_settings.alerts.delivery_deadline_seconds
    _run(a, database, delivery_settings, clock, deadline - 1)
    assert statuses(database).get("pending") == 1
    outcomes = _run(a, database, delivery_settings, clock, deadline + 1).attempts
    assert ("pager", "failed") in outcomes
    assert statuses(database).get("pending", 0) == 0


def test_a_group_key_longer_than_its_column_is_stored_and_found_again(
    database: Database,
    delivery_settings: ServerSettings,  # noqa: F811
    clock: FakeClock,
) -> None:
    """group_by rule, hostname, user with 250-character values: a key over 512
    characters. Evaluations go on (they used to fail for good on the unique key), the
    group is notified once, and other alerts are still notified."""
    settings = _with(delivery_settings, group_by=["rule", "hostname", "user"])
    hook = Recorder()
    engine = engine_of(clock, receiver("webhook", hook, clock))
    long = {**host(0), "hostname": "h" * 250, "user": "u" * 250}
    _alert(database, long)
    for k in range(3):
        _run(engine, database, settings, clock, T0 + 15 * k)
    fire(database, 1)
    for k in range(3, 5):
        _run(engine, database, settings, clock, T0 + 15 * k)

    assert len(hook.posts) == 2
    key = hook.posts[0][1]["group_key"]
    full, _ = dispatch.group_of(long, ["rule", "hostname", "user"])
    assert key == full and len(key) == dispatch.GROUP_KEY_MAX
    assert key.startswith("{rule='gpu_throttled',hostname='hhh") and "...sha256:" in key
    other = {**long, "user": "v" * 250}
    assert dispatch.group_of(other, ["rule", "hostname", "user"])[0] != key
    with database.reader() as session:
        assert len(session.scalars(select(AlertGroupRow)).all()) == 2


def test_retry_after_holds_across_a_chain_of_superseded_notifications(
    database: Database,
    delivery_settings: ServerSettings,  # noqa: F811
    clock: FakeClock,
) -> None:
    """Alertmanager down with Retry-After 300; each minute's resend supersedes the
    pending one. No POST before the 300 s have passed, however many resends since."""
    am = Recorder()
    engine = engine_of(clock, receiver("alertmanager", am, clock, name="am"))
    fire(database, 3)
    _run(engine, database, delivery_settings, clock, T0)
    am.script = [httpx.Response(503, headers={"retry-after": "300"})] * 100
    refused_at = None
    for k in range(1, 30):
        t = T0 + 15 * k
        before = len(am.posts)
        _run(engine, database, delivery_settings, clock, t)
        if len(am.posts) > before:
            if refused_at is not None:
                assert t >= refused_at + 300, f"POST at +{t - T0:.0f} s"
            refused_at = t
        with database.reader() as session:
            (state,) = receiver_states(session=session, receivers=engine.receivers)
        if refused_at is not None:
            # The receivers API tells the latest attempted outcome all along.
            assert (state.status, state.last_error is not None) == ("failing", True)
    assert len(am.posts) == 3  # T0, +60, +360


class RefusingHost7(Recorder):
    """Alertmanager refusing (400) every POST that carries host-007's alert."""

    def __call__(self, request: httpx.Request) -> httpx.Response:
        super().__call__(request)
        if any(a["labels"]["hostname"] == "host-007" for a in self.posts[-1][1]):
            return httpx.Response(400, text='{"message": "end time must not be before start"}')
        return httpx.Response(200)


def test_one_alert_alertmanager_refuses_breaks_only_its_notification(
    database: Database,
    delivery_settings: ServerSettings,  # noqa: F811
    clock: FakeClock,
) -> None:
    """Alertmanager answers 400 to a whole POST for one bad alert (keeping the
    others): the batch is split and resent until only that notification is broken."""
    am = RefusingHost7()
    engine = engine_of(clock, receiver("alertmanager", am, clock, name="am"))
    fire(database, 300)
    outcomes = _run(engine, database, delivery_settings, clock, T0).attempts
    assert sorted(set(outcomes)) == [("am", "broken"), ("am", "sent")]
    assert outcomes.count(("am", "broken")) == 1
    assert statuses(database) == {"sent": 299, "broken": 1}
    assert len(am.posts) <= 2 + 2 * 8  # two batches; halving to one: about 2 log2(256)
    with database.reader() as session:
        broken = session.scalars(
            select(NotificationRow).where(NotificationRow.status == "broken")
        ).one()
    assert broken.body["alerts"][0]["labels"]["hostname"] == "host-007"


def test_a_firing_retried_into_a_silence_is_not_sent(
    database: Database,
    delivery_settings: ServerSettings,  # noqa: F811
    clock: FakeClock,
) -> None:
    hook = Recorder(*[httpx.Response(503)] * 3)
    engine = engine_of(clock, receiver("webhook", hook, clock), rng=lambda: 0.5)
    fire(database, 1)
    _run(engine, database, delivery_settings, clock, T0)
    with database.writer() as session, session.begin():
        session.add(
            SilenceRow(
                matchers=[{"name": "hostname", "value": "host-000", "regex": False}],
                starts_at=T0 + 5,
                ends_at=T0 + 200,
                created_by="sre",
                comment="maintenance",
                created_at=T0 + 5,
            )
        )
    for k in range(1, 30):
        _run(engine, database, delivery_settings, clock, T0 + 5 * k)
    assert len(hook.posts) == 1  # the first attempt, before the silence
    assert statuses(database) == {"superseded": 1}


def test_a_receiver_without_send_resolved_gets_no_stale_firing_after_the_resolution(
    database: Database,
    delivery_settings: ServerSettings,  # noqa: F811
    clock: FakeClock,
) -> None:
    hook = Recorder(*[httpx.Response(503)] * 3)
    config = ReceiverConfig.model_validate(
        {"name": "r", "type": "webhook", "url": "https://h.example/", "secret": "k"}
        | {"send_resolved": False}
    )
    client = httpx.Client(transport=httpx.MockTransport(hook))
    engine = engine_of(clock, build_receiver(config, client=client, clock=clock), rng=lambda: 0.5)
    fire(database, 2)  # host 1 keeps its own group firing
    _run(engine, database, delivery_settings, clock, T0)
    _resolve(database, 0, T0 + 3)
    for k in range(1, 20):
        _run(engine, database, delivery_settings, clock, T0 + 3 + 5 * k)
    told = [
        (a["labels"]["hostname"], a["status"]) for _, body in hook.posts for a in body["alerts"]
    ]
    after = told[2:]  # the two first attempts, at T0
    assert ("host-000", "firing") not in after
    assert ("host-001", "firing") in after  # still firing: its retry goes out
    assert statuses(database) == {"superseded": 1, "sent": 1}


@pytest.mark.parametrize("groups", [1500])
def test_notifications_are_written_in_bulk_and_counted_exactly(
    database: Database,
    delivery_settings: ServerSettings,  # noqa: F811
    clock: FakeClock,
    groups: int,
) -> None:
    """Thousands of notifications in a few statements (not one INSERT each: 10,000
    groups held SQLite's write lock for 6 s), and ``planned`` is the number inserted
    on both databases (Postgres' executemany rowcount is -1)."""
    engine = _alertmanager_and_webhook(clock)
    fire(database, groups)
    statements: list[str] = []

    def count(*args: Any) -> None:
        statements.append(args[2])

    event.listen(database.engine, "before_cursor_execute", count)
    try:
        result = engine.evaluate(database=database, settings=delivery_settings, now=T0)
    finally:
        event.remove(database.engine, "before_cursor_execute", count)
    assert result.planned == 2 * groups
    inserts = [s for s in statements if s.lstrip().upper().startswith("INSERT INTO NOTIFICATIONS")]
    assert 0 < len(inserts) <= 2 * groups // 500
    # Planned again at the same flush time (a replica that lost the race): none added.
    with database.writer() as session, session.begin():
        session.execute(update(AlertGroupRow).values(notified_at=None, notified_firing=[]))
        session.execute(update(AlertGroupRow).values(flushed_at=None))
    assert engine.evaluate(database=database, settings=delivery_settings, now=T0).planned == 0


@pytest.mark.postgres
def test_on_postgres_each_write_chunk_is_one_statement_over_arrays(
    postgres_url: str, clock: FakeClock
) -> None:
    """3,000 notifications and 3,000 groups are two write chunks (``WRITE_CHUNK``):
    on Postgres each chunk's pending notifications are read, its notifications inserted
    and the older ones superseded in one statement each, and its groups written in one,
    where Core's executemany sent statements of 1,000 rows (and the read went by group
    key, in lists of 1,000). What they write reads back as written."""
    from gpuwatch.server.database import create_database
    from gpuwatch.server.database.migrate import upgrade

    database = create_database(postgres_url)
    upgrade(database)
    settings = ServerSettings.model_validate(
        {
            "database_url": postgres_url,
            "scheduler": False,
            "alerts": {
                "group_wait": "0s",
                "group_interval": "1s",
                "repeat_interval": "1h",
                "rules": {"gpu_throttled": {"keep_firing_for": "1d"}},
            },
        }
    )
    engine = _alertmanager_and_webhook(clock)
    fire(database, 1500)
    statements: list[str] = []

    def count(*args: Any) -> None:
        statements.append(" ".join(args[2].split()).upper())

    def kinds() -> dict[str, int]:
        prefixes = {
            "insert": "INSERT INTO NOTIFICATIONS",
            "read": "SELECT NOTIFICATIONS.ID",
            "supersede": "UPDATE NOTIFICATIONS SET STATUS",
            "groups": "INSERT INTO ALERT_GROUPS",
            "groups_update": "UPDATE ALERT_GROUPS",
        }
        return {k: sum(s.startswith(p) for s in statements) for k, p in prefixes.items()}

    event.listen(database.engine, "before_cursor_execute", count)
    try:
        assert engine.evaluate(database=database, settings=settings, now=T0).planned == 3000
        assert kinds() == {"insert": 2, "read": 2, "supersede": 0, "groups": 2, "groups_update": 0}
        statements.clear()
        # A minute on, Alertmanager's resend: 1,500 new ones supersede the 1,500 pending
        # (and all 3,000 groups record the look).
        assert engine.evaluate(database=database, settings=settings, now=T0 + 60).planned == 1500
        assert kinds() == {"insert": 1, "read": 1, "supersede": 1, "groups": 0, "groups_update": 2}
        assert statuses(database) == {"pending": 3000, "superseded": 1500}
        with database.reader() as session:
            am = session.scalars(select(AlertGroupRow).where(AlertGroupRow.receiver == "am"))
            group = am.first()
            newest = session.scalars(
                select(NotificationRow).where(NotificationRow.status == "pending").limit(1)
            ).one()
    finally:
        event.remove(database.engine, "before_cursor_execute", count)
        database.dispose()
    assert group is not None and group.flushed_at == T0 + 60
    assert group.group_labels == {"rule": "gpu_throttled", "hostname": "host-000"}
    assert group.notified_firing == [fingerprint(host(0))]
    assert newest.body["alerts"][0]["labels"]["rule"] == "gpu_throttled"
