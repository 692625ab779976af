"""The alert engine's life cycle and timers, as Alertmanager's acceptance tests check them.

Real parts: snapshots through the real ingest, the real engine on SQLite and Postgres,
a real signed webhook receiver posting over HTTP to a local server. Time is injected:
each test moves a fake clock and runs the engine at chosen instants, so "exactly one
notification at t = 30 s" is a plain assertion. The signal is a GPU that falls off the
bus (``gpu_lost``: fires at once, no ``for``), one per host or per GPU as a test needs.
"""

from __future__ import annotations

import hashlib
import hmac
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from sqlalchemy import select, text
from support.sink import Sink, sink

from gpuwatch.server.alerts.engine import AlertEngine
from gpuwatch.server.alerts.models import NotificationRow
from gpuwatch.server.alerts.schemas import SilenceIn
from gpuwatch.server.alerts.service import create_silence, expire_silence
from gpuwatch.server.database import Database
from gpuwatch.server.ingest.service import ingest_snapshots
from gpuwatch.server.metrics import ServerStats
from gpuwatch.server.notifications.config import ReceiverConfig
from gpuwatch.server.notifications.receivers.base import build_receiver
from gpuwatch.server.scheduler import JobSpec, run_job
from gpuwatch.settings import ServerSettings
from gpuwatch.wire import IngestRequest
from server.factories import T0, gpu, process, snapshot
from server.harness import FakeClock, make_token

SECRET = "timeline-secret"


@pytest.fixture
def alert_settings(tmp_path: Any, database_url: str) -> ServerSettings:
    return ServerSettings.model_validate(
        {
            "data_dir": tmp_path,
            "database_url": database_url,
            "scheduler": False,
            "agent_push_interval_seconds": 15,
            "alerts": {
                "group_wait": "30s",
                "group_interval": "5m",
                "repeat_interval": "30m",
                "group_by": ["rule", "hostname"],
            },
        }
    )


@pytest.fixture
def hook(clock: FakeClock) -> Iterator[Sink]:
    with sink(clock) as s:
        yield s


class Timeline:
    """Pushes snapshots and runs the engine at instants of the fake clock."""

    def __init__(self, database: Database, settings: ServerSettings, clock: FakeClock, hook: Sink):
        self.database, self.settings, self.clock, self.hook = database, settings, clock, hook
        self.client = httpx.Client()
        self.sequence: dict[str, int] = {}
        self.engine = self.new_engine()

    def new_engine(self) -> AlertEngine:
        """A fresh engine on the same database: what a restart or a replica has."""
        config = ReceiverConfig(name="hook", type="webhook", url=self.hook.url, secret=SECRET)
        receiver = build_receiver(config, client=self.client, clock=self.clock)
        return AlertEngine(receivers={"hook": receiver}, clock=self.clock, sleep=self.clock.advance)

    def gpus(self, host: str, lost: set[int], at: float) -> None:
        """One snapshot of ``host`` at ``at`` with GPUs 0 and 1, those in ``lost`` lost."""
        if host not in self.sequence:
            make_token(self.database, host)
            self.sequence[host] = 0
        self.sequence[host] += 1
        gpus = [
            gpu(i, lost=True, memory_used_bytes=None, memory_free_bytes=None)
            if i in lost
            else gpu(i, [process(100 + i)])
            for i in (0, 1)
        ]
        snap = snapshot(self.sequence[host], gpus, hostname=host, at=at)
        with self.database.writer() as session, session.begin():
            host_id = session.scalar(text("SELECT id FROM hosts WHERE hostname = :h"), {"h": host})
            ingest_snapshots(
                session=session,
                dialect=self.database.dialect,
                host_id=host_id,
                request=IngestRequest(snapshots=[snap]),
                settings=self.settings,
                now=at,
            )

    def run(self, at: float, engine: AlertEngine | None = None) -> None:
        self.clock.now = max(self.clock.now, at)
        (engine or self.engine).run(database=self.database, settings=self.settings, now=at)

    def run_every(self, start: float, end: float, step: float = 15.0) -> None:
        t = start
        while t <= end:
            self.run(t)
            t += step

    def bodies(self) -> list[dict[str, Any]]:
        return [d.body for d in self.hook.deliveries]


@pytest.fixture
def timeline(
    database: Database, alert_settings: ServerSettings, clock: FakeClock, hook: Sink
) -> Iterator[Timeline]:
    t = Timeline(database, alert_settings, clock, hook)
    yield t
    t.client.close()


def gpus_in(body: dict[str, Any], status: str = "firing") -> list[str]:
    return sorted(a["labels"]["gpu"] for a in body["alerts"] if a["status"] == status)


def test_group_wait_then_one_signed_notification(timeline: Timeline, hook: Sink) -> None:
    timeline.gpus("host-1", {0}, at=T0)
    timeline.run_every(T0, T0 + 120)

    assert hook.at() == [T0 + 30]
    (delivery,) = hook.deliveries
    expected = "sha256=" + hmac.new(SECRET.encode(), delivery.raw, hashlib.sha256).hexdigest()
    assert hmac.compare_digest(delivery.headers["X-Gpuwatch-Signature"], expected)
    body = delivery.body
    assert body["status"] == "firing"
    (alert,) = body["alerts"]
    assert alert["rule"] == "gpu_lost" and alert["labels"]["hostname"] == "host-1"
    assert alert["starts_at"] == T0 and alert["ends_at"] is None


def test_an_alert_resolved_before_group_wait_is_never_sent(timeline: Timeline, hook: Sink) -> None:
    timeline.gpus("host-1", {0}, at=T0)
    timeline.run(T0)
    timeline.gpus("host-1", set(), at=T0 + 10)
    timeline.run_every(T0 + 15, T0 + 3600, step=60)

    assert hook.deliveries == []


def test_group_interval_batches_what_fired_since_and_repeat_interval_repeats(
    timeline: Timeline, hook: Sink
) -> None:
    timeline.gpus("host-1", {0}, at=T0)
    timeline.run_every(T0, T0 + 60)
    timeline.gpus("host-1", {0, 1}, at=T0 + 60)  # a second GPU of the same host
    timeline.run_every(T0 + 60, T0 + 3000)

    # First look at 30 s; the next at 30 s + 5 min carries both; nothing changes after,
    # so the next is the repeat, 30 min after the last notification.
    assert hook.at() == [T0 + 30, T0 + 330, T0 + 330 + 1800]
    assert [gpus_in(b) for b in timeline.bodies()] == [["0"], ["0", "1"], ["0", "1"]]


def test_resolved_notification_at_the_next_look(timeline: Timeline, hook: Sink) -> None:
    timeline.gpus("host-1", {0}, at=T0)
    timeline.run_every(T0, T0 + 60)
    timeline.gpus("host-1", set(), at=T0 + 100)
    timeline.run_every(T0 + 105, T0 + 900)

    assert hook.at() == [T0 + 30, T0 + 330]
    resolved = timeline.bodies()[1]
    assert resolved["status"] == "resolved"
    (alert,) = resolved["alerts"]
    assert alert["status"] == "resolved" and alert["ends_at"] == T0 + 105


def test_groups_are_per_host_and_each_waits_its_own_group_wait(
    timeline: Timeline, hook: Sink
) -> None:
    timeline.gpus("host-1", {0}, at=T0)
    timeline.run(T0)
    timeline.gpus("host-2", {1}, at=T0 + 15)
    timeline.run_every(T0 + 15, T0 + 120)

    hosts = [(d.at, d.body["group_labels"]["hostname"]) for d in hook.deliveries]
    assert hosts == [(T0 + 30, "host-1"), (T0 + 45, "host-2")]


def test_a_silence_mutes_until_it_is_expired(timeline: Timeline, hook: Sink) -> None:
    with timeline.database.writer() as session, session.begin():
        silence = create_silence(
            session=session,
            silence=SilenceIn.model_validate(
                {
                    "matchers": [{"name": "hostname", "value": "host-1"}],
                    "duration_seconds": 3600,
                    "created_by": "sre",
                    "comment": "maintenance",
                }
            ),
            now=T0,
        )
    timeline.gpus("host-1", {0}, at=T0)
    timeline.gpus("host-2", {0}, at=T0)
    timeline.run_every(T0, T0 + 600)
    assert [d.body["group_labels"]["hostname"] for d in hook.deliveries] == ["host-2"]

    with timeline.database.writer() as session, session.begin():
        expire_silence(session=session, silence_id=silence.id, now=T0 + 600)
    timeline.run_every(T0 + 615, T0 + 700)
    assert [d.body["group_labels"]["hostname"] for d in hook.deliveries] == ["host-2", "host-1"]
    assert hook.at()[1] == T0 + 645  # the first look after group_wait, counted from unmuting


def test_a_restart_between_firing_and_repeat_loses_nothing_and_repeats_nothing_early(
    timeline: Timeline, hook: Sink
) -> None:
    timeline.gpus("host-1", {0}, at=T0)
    timeline.run_every(T0, T0 + 600)
    restarted = timeline.new_engine()  # nothing in memory survives
    t = T0 + 615
    while t <= T0 + 2400:
        timeline.run(t, restarted)
        t += 15

    assert hook.at() == [T0 + 30, T0 + 30 + 1800]


class KilledAfterSend(Exception):
    pass


def test_killed_between_sending_and_recording_sends_at_most_one_duplicate(
    timeline: Timeline, hook: Sink
) -> None:
    timeline.gpus("host-1", {0}, at=T0)
    timeline.run(T0)
    dying = timeline.new_engine()
    real = dying.receivers["hook"]

    class Dies:
        name, type, send_resolved = real.name, real.type, real.send_resolved
        min_interval_seconds = real.min_interval_seconds

        def attempt(self, notification: Any) -> Any:
            real.attempt(notification)
            raise KeyboardInterrupt  # the process dies before it records the outcome

    dying.receivers["hook"] = Dies()  # type: ignore[assignment]
    with pytest.raises(KeyboardInterrupt):
        timeline.run(T0 + 30, dying)
    assert len(hook.deliveries) == 1

    lease = timeline.settings.alerts.delivery_lease_seconds
    timeline.run_every(T0 + 45, T0 + 30 + lease + 30)
    assert len(hook.deliveries) == 2  # sent again once its lease ran out, not more
    with timeline.database.reader() as session:
        (status,) = session.scalars(select(NotificationRow.status)).all()
    assert status == "sent"


def test_a_failing_receiver_is_retried_with_backoff_until_it_answers(
    timeline: Timeline, hook: Sink
) -> None:
    hook.status = 503
    timeline.gpus("host-1", {0}, at=T0)
    timeline.run_every(T0, T0 + 90)
    failures = len(hook.deliveries)
    hook.status = 200
    timeline.run_every(T0 + 105, T0 + 400)

    assert 2 <= failures <= 5  # backed off: not one attempt per evaluation
    with timeline.database.reader() as session:
        (status,) = session.scalars(select(NotificationRow.status)).all()
    assert status == "sent"
    assert len(hook.deliveries) == failures + 1


@pytest.mark.postgres
def test_two_replicas_on_postgres_send_each_notification_once(
    postgres_url: str, tmp_path: Any, clock: FakeClock, hook: Sink
) -> None:
    from gpuwatch.server.database import create_database
    from gpuwatch.server.database.migrate import upgrade

    database = create_database(postgres_url)
    upgrade(database)
    settings = ServerSettings.model_validate(
        {"data_dir": tmp_path, "database_url": postgres_url, "scheduler": False}
    )
    timeline = Timeline(database, settings, clock, hook)
    replicas = [timeline.new_engine(), timeline.new_engine()]
    for host in ("host-1", "host-2", "host-3"):
        timeline.gpus(host, {0}, at=T0)
    try:
        for t in (T0, T0 + 15, T0 + 30, T0 + 45, T0 + 60):
            clock.now = t
            threads = [
                threading.Thread(
                    target=run_job,
                    args=[JobSpec("alerts", engine.run, 15)],
                    kwargs={
                        "database": database,
                        "settings": settings,
                        "clock": clock,
                        "stats": ServerStats(),
                    },
                )
                for engine in replicas
            ]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
    finally:
        timeline.client.close()
        database.dispose()

    hosts = sorted(d.body["group_labels"]["hostname"] for d in hook.deliveries)
    assert hosts == ["host-1", "host-2", "host-3"]


def test_an_xid_reported_by_the_agent_is_notified_once_and_resolves(
    timeline: Timeline, hook: Sink
) -> None:
    def health(at: float, xid: int) -> None:
        timeline.sequence.setdefault("host-1", 0)
        if timeline.sequence["host-1"] == 0:
            make_token(timeline.database, "host-1")
        timeline.sequence["host-1"] += 1
        sick = gpu(0, [process(100)], xid_errors=xid, xid_last_code=79 if xid else None)
        snap = snapshot(timeline.sequence["host-1"], [sick], hostname="host-1", at=at)
        with timeline.database.writer() as session, session.begin():
            host_id = session.scalar(text("SELECT id FROM hosts WHERE hostname = 'host-1'"))
            ingest_snapshots(
                session=session,
                dialect=timeline.database.dialect,
                host_id=host_id,
                request=IngestRequest(snapshots=[snap]),
                settings=timeline.settings,
                now=at,
            )

    # The agent pushes every 15 s; it sees one Xid event at 15 s, and none after.
    t = T0
    while t <= T0 + 1500:
        health(t, 0 if t < T0 + 15 else 1)
        timeline.run(t)
        t += 15

    bodies = timeline.bodies()
    assert [b["status"] for b in bodies] == ["firing", "resolved"]
    (alert,) = bodies[0]["alerts"]
    assert alert["rule"] == "gpu_xid" and "Xid 79" in alert["summary"]


def test_a_reaper_warning_is_announced_once_and_ends_unannounced(
    timeline: Timeline, hook: Sink
) -> None:
    from gpuwatch.server.events.service import record_reported_event
    from gpuwatch.wire import ReportedEvent

    make_token(timeline.database, "host-1")
    warning = ReportedEvent(
        kind="reaped",
        hostname="host-1",
        gpu_index=1,
        pid=4242,
        user="alice",
        held_bytes=11 * 2**30,
        summary="pid 4242 (alice, jupyter kernel, 11 GiB on gpu1) will be stopped in 30 min "
        "unless it becomes active",
        evidence={"stage": "warning", "detail": "idle for 2 h on a contended GPU"},
        occurred_at=T0,
    )
    with timeline.database.writer() as session, session.begin():
        host_id = session.scalar(text("SELECT id FROM hosts WHERE hostname = 'host-1'"))
        record_reported_event(
            session=session, host_id=host_id, report=warning, dialect=timeline.database.dialect
        )
    timeline.run_every(T0, T0 + 3600, step=60)

    (body,) = timeline.bodies()
    (alert,) = body["alerts"]
    assert alert["rule"] == "process_reaped"
    assert (alert["labels"]["user"], alert["labels"]["stage"]) == ("alice", "warning")
    assert "will be stopped in 30 min" in alert["summary"]


def _silence(timeline: Timeline, at: float, seconds: float, **labels: str) -> int:
    with timeline.database.writer() as session, session.begin():
        made = create_silence(
            session=session,
            silence=SilenceIn.model_validate(
                {
                    "matchers": [{"name": k, "value": v} for k, v in labels.items()],
                    "duration_seconds": seconds,
                    "created_by": "sre",
                    "comment": "maintenance",
                }
            ),
            now=at,
        )
    return made.id


def _pushing(timeline: Timeline, lost: set[int], start: float, end: float, step: float) -> None:
    """The agent of host-1 pushes (GPUs in ``lost`` lost) and the engine runs, every
    ``step`` from ``start`` to ``end``: the host never looks silent."""
    t = start
    while t <= end:
        timeline.gpus("host-1", lost, at=t)
        timeline.run(t)
        t += step


def test_a_resolution_during_a_silence_is_sent_when_the_silence_ends(
    timeline: Timeline, hook: Sink, clock: FakeClock
) -> None:
    """A page notified before a silence, resolved within it, must not stay open in the
    receivers for good (real Alertmanager 0.25 never sends that resolution:
    prometheus/alertmanager#226). The silence holds it, and outlasts
    ``resolved_retention`` (1 day): the resolution goes to the webhook and to Slack once
    the silence ends, and nothing goes out during it."""
    with sink(clock) as slack_hook:
        client = timeline.client
        slack = ReceiverConfig.model_validate(
            {"name": "slack", "type": "slack", "url": slack_hook.url}
        )
        engine = AlertEngine(
            receivers={
                "hook": timeline.engine.receivers["hook"],
                "slack": build_receiver(slack, client=client, clock=clock),
            },
            clock=clock,
            sleep=clock.advance,
        )
        timeline.engine = engine
        _pushing(timeline, {0}, T0, T0 + 60, step=15)
        assert [(b["status"], gpus_in(b)) for b in timeline.bodies()] == [("firing", ["0"])]
        assert len(slack_hook.deliveries) == 1

        ends = T0 + 60 + 2 * 86400
        _silence(timeline, T0 + 60, ends - (T0 + 60), hostname="host-1")
        _pushing(timeline, set(), T0 + 75, T0 + 900, step=15)  # resolves at T0 + 75
        _pushing(timeline, set(), T0 + 900, ends - 1, step=3600)
        assert len(hook.deliveries) == len(slack_hook.deliveries) == 1  # nothing inside it

        _pushing(timeline, set(), ends, ends + 600, step=15)

    assert hook.at()[1:] == [ends + 30]  # the first look after group_wait, from unmuting
    resolved = timeline.bodies()[1]
    assert resolved["status"] == "resolved"
    (alert,) = resolved["alerts"]
    assert (alert["status"], alert["labels"]["gpu"], alert["ends_at"]) == ("resolved", "0", T0 + 75)
    assert len(slack_hook.deliveries) == 2
    assert slack_hook.deliveries[1].body["text"].startswith("✅ Resolved")


def test_a_resolution_of_one_silenced_alert_of_a_group_is_sent_when_its_silence_ends(
    timeline: Timeline, hook: Sink
) -> None:
    """GPU 0 and GPU 1 of one host are one group. GPU 0 is silenced, resolves within the
    silence while GPU 1 keeps firing: once the silence ends the group tells that GPU 0
    resolved (it was forgotten while GPU 1's state was written)."""
    _pushing(timeline, {0, 1}, T0, T0 + 60, step=15)
    ends = T0 + 1200  # before GPU 1's repeat (30 min)
    _silence(timeline, T0 + 60, ends - (T0 + 60), hostname="host-1", gpu="0")
    _pushing(timeline, {1}, T0 + 75, ends - 15, step=15)
    assert [(b["status"], gpus_in(b)) for b in timeline.bodies()] == [("firing", ["0", "1"])]

    _pushing(timeline, {1}, ends, ends + 600, step=15)

    told = [(gpus_in(b), gpus_in(b, "resolved")) for b in timeline.bodies()[1:]]
    assert told == [(["1"], ["0"])]
    assert hook.at()[1:] == [ends + 30]  # the group's next look (every 5 min from T0 + 30)


def test_an_alert_still_firing_when_its_silence_ends_is_not_announced_again_as_new(
    timeline: Timeline, hook: Sink
) -> None:
    """The receiver was told it fires and was never told otherwise: after the silence it
    repeats once ``repeat_interval`` (30 min) has passed since the last notification, as
    any firing alert does, rather than being announced as new at the end of the silence.
    The silence ends at T0 + 660; the group's looks follow from T0 + 690, every 5 min,
    and the first at least 30 min after T0 + 30 is T0 + 1890."""
    _pushing(timeline, {0}, T0, T0 + 60, step=15)
    _silence(timeline, T0 + 60, 600, hostname="host-1")
    _pushing(timeline, {0}, T0 + 75, T0 + 2400, step=15)

    assert hook.at() == [T0 + 30, T0 + 1890]
    assert [gpus_in(b) for b in timeline.bodies()] == [["0"], ["0"]]
