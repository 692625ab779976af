"""The notifications audit's findings: resolutions owed across a receiver outage longer
than the delivery deadline, backlog order, receiver state, hostile text in Slack,
route values, Retry-After, truncation, the alerts CLI and skipped job runs.

The real engine on SQLite (and Postgres where configured), mock HTTP transports and an
injected clock: nothing sleeps.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import httpx
import pytest
from apscheduler.events import EVENT_JOB_MAX_INSTANCES, JobSubmissionEvent
from pydantic import ValidationError
from sqlalchemy import select, update

from gpuwatch.cli.alerts import _alert_rows
from gpuwatch.server.alerts.config import AlertSettings
from gpuwatch.server.alerts.engine import RETRY_AFTER_CAP_SECONDS, AlertEngine
from gpuwatch.server.alerts.lifecycle import AlertState, advance
from gpuwatch.server.alerts.models import AlertGroupRow, AlertRow, NotificationRow
from gpuwatch.server.alerts.rules import fingerprint, resolved_summary
from gpuwatch.server.alerts.schemas import AlertOut, CulpritOut
from gpuwatch.server.alerts.service import receiver_states
from gpuwatch.server.database import Database
from gpuwatch.server.metrics import ServerStats
from gpuwatch.server.notifications.model import Culprit, Notification, NotifiedAlert
from gpuwatch.server.notifications.receivers import slack
from gpuwatch.server.notifications.receivers.alertmanager import payload as am_payload
from gpuwatch.server.notifications.receivers.text import cut, shorten
from gpuwatch.server.scheduler import count_busy
from gpuwatch.settings import ServerSettings
from server.factories import T0
from server.harness import FakeClock

# The shared fixture, imported so pytest finds it here.
from server.test_alerts_delivery import (
    Recorder,
    delivery_settings,  # noqa: F401
    engine_of,
    receiver,
)


class Hook(Recorder):
    """A mock receiver endpoint that is up (200) or down (500, or 429 with
    ``retry_after``), and keeps every POST with the answer it got."""

    def __init__(self) -> None:
        super().__init__()
        self.up = True
        self.retry_after: str | None = None
        self.answers: list[tuple[int, Any]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        status = 200 if self.up else (429 if self.retry_after else 500)
        self.answers.append((status, json.loads(request.content)))
        headers = {"retry-after": self.retry_after} if self.retry_after and not self.up else {}
        return httpx.Response(status, text="ok", headers=headers)

    def delivered(self) -> list[tuple[str, str]]:
        """(status, fingerprint) of every alert in a POST answered 200."""
        return [
            (alert["status"], alert["fingerprint"])
            for status, body in self.answers
            if status == 200
            for alert in body["alerts"]
        ]


def _with(settings: ServerSettings, **alerts: Any) -> ServerSettings:
    return settings.model_copy(update={"alerts": settings.alerts.model_copy(update=alerts)})


def _labels(gpu: int = 0, severity: str = "warning", host: str = "host-001") -> dict[str, str]:
    return {"rule": "gpu_throttled", "severity": severity, "hostname": host, "gpu": str(gpu)}


def _fire(database: Database, labels: dict[str, str], at: float = T0) -> str:
    with database.writer() as session, session.begin():
        session.add(
            AlertRow(
                fingerprint=fingerprint(labels),
                rule=labels["rule"],
                labels=labels,
                severity=labels["severity"],
                state="firing",
                summary=f"GPU {labels['gpu']} on {labels['hostname']}",
                description="",
                culprits=[],
                active_since=at,
                fired_at=at,
                last_true_at=at,
            )
        )
    return fingerprint(labels)


def _resolve(database: Database, fp: str, at: float) -> None:
    with database.writer() as session, session.begin():
        session.execute(
            update(AlertRow)
            .where(AlertRow.fingerprint == fp)
            .values(state="resolved", resolved_at=at)
        )


def _run_until(engine: AlertEngine, database: Database, settings: ServerSettings,
               clock: FakeClock, start: float, end: float, step: float = 60.0) -> None:  # fmt: skip
    t = start
    while t <= end:
        clock.now = max(clock.now, t)
        engine.run(database=database, settings=settings, now=t)
        t += step


# H1 ------------------------------------------------------------------------------------


def test_a_resolution_owed_survives_an_outage_longer_than_the_deadline(
    database: Database,
    delivery_settings: ServerSettings,  # noqa: F811
    clock: FakeClock,
) -> None:
    """Told firing -> receiver down -> the alert resolves -> the resolution is given up
    at its deadline -> the receiver is back: it hears "resolved", exactly once. The
    resolved alert is kept past resolved_retention while the resolution is owed.
    Before the fix the give-up cleared the group's record and nothing more was sent."""
    settings = _with(delivery_settings, resolved_retention_seconds=120.0)
    deadline = settings.alerts.delivery_deadline_seconds
    hook = Hook()
    engine = engine_of(clock, receiver("webhook", hook, clock, name="hook"))
    fp = _fire(database, _labels())
    _run_until(engine, database, settings, clock, T0, T0)
    assert hook.delivered() == [("firing", fp)]

    hook.up = False
    _resolve(database, fp, T0 + 10)
    # Down for twice the deadline: the resolution is given up at least once.
    _run_until(engine, database, settings, clock, T0 + 10, T0 + 10 + 2 * deadline + 120)
    with database.reader() as session:
        given_up = session.scalars(
            select(NotificationRow).where(NotificationRow.status == "failed")
        ).all()
        kept = session.scalars(select(AlertRow).where(AlertRow.fingerprint == fp)).all()
    assert given_up, "the outage outlasted the deadline"
    assert [row.state for row in kept] == ["resolved"]  # past its retention: owed
    assert hook.delivered() == [("firing", fp)]

    hook.up = True
    back = clock.now
    _run_until(engine, database, settings, clock, back, back + 6 * 3600, step=300.0)
    assert hook.delivered() == [("firing", fp), ("resolved", fp)]
    # Delivered: nothing is owed any more, and the resolved row ages out.
    with database.reader() as session:
        (group,) = session.scalars(select(AlertGroupRow)).all()
        assert group.delivered_firing == [] and group.notified_firing == []
        assert session.scalars(select(AlertRow)).all() == []


def test_resolutions_riding_with_firing_alerts_are_not_dropped_at_the_deadline(
    database: Database,
    delivery_settings: ServerSettings,  # noqa: F811
    clock: FakeClock,
) -> None:
    """One group, two alerts told firing; one resolves while the receiver is down, so the
    notification given up carried a resolution and a firing alert. Once back, the
    receiver hears both: the resolution, and the alert that still fires."""
    # No repeat within the outage: a repeat would supersede the retried notification
    # (carrying its resolution over) before its deadline.
    settings = _with(delivery_settings, repeat_interval_seconds=6 * 3600.0)
    hook = Hook()
    engine = engine_of(clock, receiver("webhook", hook, clock, name="hook"))
    a, b = _fire(database, _labels(0)), _fire(database, _labels(1))
    _run_until(engine, database, settings, clock, T0, T0)
    assert sorted(hook.delivered()) == sorted([("firing", a), ("firing", b)])

    hook.up = False
    _resolve(database, a, T0 + 10)
    deadline = settings.alerts.delivery_deadline_seconds
    _run_until(engine, database, settings, clock, T0 + 10, T0 + deadline + 300)
    with database.reader() as session:
        (given_up,) = session.scalars(
            select(NotificationRow).where(NotificationRow.status == "failed")
        ).all()
    assert sorted(a["status"] for a in given_up.body["alerts"]) == ["firing", "resolved"]
    hook.up = True
    _run_until(engine, database, settings, clock, clock.now + 60, clock.now + 3600)

    later = hook.delivered()[2:]
    assert later.count(("resolved", a)) == 1
    assert ("firing", b) in later


def test_a_receiver_without_send_resolved_pins_no_resolved_alert(
    database: Database,
    delivery_settings: ServerSettings,  # noqa: F811
    clock: FakeClock,
) -> None:
    """The delivered record must not keep a resolved row forever for a receiver that is
    owed no resolution."""
    settings = _with(delivery_settings, resolved_retention_seconds=60.0)
    hook = Hook()
    config_receiver = receiver("webhook", hook, clock, name="hook")
    config_receiver.send_resolved = False  # type: ignore[misc]
    engine = engine_of(clock, config_receiver)
    fp = _fire(database, _labels())
    _run_until(engine, database, settings, clock, T0, T0)
    _resolve(database, fp, T0 + 10)
    _run_until(engine, database, settings, clock, T0 + 10, T0 + 600)
    with database.reader() as session:
        assert session.scalars(select(AlertRow)).all() == []
    assert hook.delivered() == [("firing", fp)]


# M1 ------------------------------------------------------------------------------------


def test_a_backlog_is_claimed_most_severe_first(
    database: Database,
    delivery_settings: ServerSettings,  # noqa: F811
    clock: FakeClock,
) -> None:
    """Warnings queued for a receiver that was down; a critical alert planned after them
    is sent first once it is back."""
    hook = Hook()
    hook.up = False
    engine = engine_of(clock, receiver("webhook", hook, clock, name="hook"))
    for h in range(5):
        _fire(database, _labels(host=f"host-{h:03d}"))
    _run_until(engine, database, delivery_settings, clock, T0, T0)
    critical = _fire(database, _labels(severity="critical", host="host-999"), at=T0 + 1)
    _run_until(engine, database, delivery_settings, clock, T0 + 1, T0 + 1)
    hook.up = True
    hook.answers.clear()
    _run_until(engine, database, delivery_settings, clock, T0 + 300, T0 + 300)
    assert len(hook.delivered()) == 6
    assert hook.delivered()[0] == ("firing", critical)


# M2 ------------------------------------------------------------------------------------


def _receiver_status(database: Database, engine: AlertEngine) -> Any:
    with database.reader() as session:
        (state,) = receiver_states(session=session, receivers=engine.receivers)
    return state


def test_notifications_expired_unattempted_make_the_receiver_failing(
    database: Database,
    delivery_settings: ServerSettings,  # noqa: F811
    clock: FakeClock,
) -> None:
    """Delivered once, then a backlog that expired without an attempt (the endpoint held
    by a Retry-After): the receiver reads ``failing``, with the count, not ``ok``."""
    hook = Hook()
    engine = engine_of(clock, receiver("webhook", hook, clock, name="hook"))
    _fire(database, _labels())
    _run_until(engine, database, delivery_settings, clock, T0, T0)
    assert _receiver_status(database, engine).status == "ok"

    for h in range(2, 5):
        _fire(database, _labels(host=f"host-{h:03d}"), at=T0 + 10)
    engine._paused_until[engine._endpoint("hook")] = float("inf")  # asked to wait
    _run_until(engine, database, delivery_settings, clock, T0 + 10, T0 + 10)
    with database.writer() as session, session.begin():  # their deadline passes
        session.execute(update(NotificationRow).values(deadline_at=T0 + 20))
    engine.deliver(database=database, now=T0 + 30, lease_seconds=120.0)
    state = _receiver_status(database, engine)
    assert state.status == "failing"
    assert state.failed == 3
    assert "deadline passed before an attempt" in (state.last_error or "")


def test_a_first_attempt_in_flight_does_not_hide_the_receiver_state(
    database: Database,
    delivery_settings: ServerSettings,  # noqa: F811
    clock: FakeClock,
) -> None:
    hook = Hook()
    engine = engine_of(clock, receiver("webhook", hook, clock, name="hook"))
    _fire(database, _labels())
    _run_until(engine, database, delivery_settings, clock, T0, T0)
    _fire(database, _labels(host="host-002"), at=T0 + 5)
    engine.evaluate(database=database, settings=delivery_settings, now=T0 + 5)
    # Leased, not yet answered (what another replica's run looks like mid-send).
    claimed, _ = engine._claim(database, T0 + 5, 120.0, "hook", ["hook"])
    assert len(claimed) == 1
    assert _receiver_status(database, engine).status == "ok"


# M3 ------------------------------------------------------------------------------------

HOSTILE = "<!channel> *x* _y_ ~z~ `q` \u202eevil\u202c\nnewline <@U012AB3CD>" + "W" * 300


def _hostile_notification(status: str = "firing") -> Notification:
    labels = _labels() | {"user": HOSTILE}
    alert = NotifiedAlert(
        rule="gpu_throttled",
        status=status,  # type: ignore[arg-type]
        labels=labels,
        summary="GPU 0 on host-001 (python *bold*)",
        description="line one \u202e\nline two",
        starts_at=T0,
        ends_at=None,
        fingerprint=fingerprint(labels),
        culprits=[
            Culprit(
                4242,
                HOSTILE,
                "python train.py",
                2**30,
                container_id="c\u202e\n" + "x" * 300,
                pod_uid="p\nq",
                slurm_job_id="j\u202e*1*",
            )
        ],
    )
    return Notification("team", "{}", {}, "firing", [alert])


def test_user_given_text_in_slack_is_one_line_escaped_bounded_and_cannot_format() -> None:
    message = slack.render(_hostile_notification())
    texts = [
        element["text"] if isinstance(element, dict) else element
        for block in message["blocks"]
        for element in (
            [block["text"]["text"]]
            if "text" in block and isinstance(block["text"], dict)
            else [e["text"] for e in block.get("elements", []) if "text" in e]
        )
    ]
    culprits = next(t for t in texts if t.startswith("*Culprits*"))
    lines = culprits.split("\n")
    assert len(lines) == 2, culprits  # the owner's newline did not forge a line
    owner = lines[1].split("*")[1]  # the bold owner name: nothing inside closed it
    assert "\\u202e" in owner and len(owner) < 120  # escaped, folded, bounded
    assert "∗x∗" in owner and "ˍyˍ" in owner and "∼z∼" in owner
    assert "&lt;!channel&gt;" in owner
    for text in [*texts, message["text"]]:
        assert "\u202e" not in text and "\u202c" not in text
        assert "<!channel>" not in text and "<@U012AB3CD>" not in text
    context = next(t for t in texts if "hostname=host-001" in t)
    assert "\n" not in context and "W" * 100 not in context
    # A summary's "*" no longer closes the bold around it.
    assert "∗bold∗" in next(t for t in texts if t.startswith("🔴"))


def test_alertmanager_label_values_are_printable() -> None:
    (item,) = am_payload(_hostile_notification())
    assert "\u202e" not in item["labels"]["user"] and "\n" not in item["labels"]["user"]
    assert "\u202e" not in item["annotations"]["culprits"]


# M4 ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("route", "says"),
    [
        ({"receiver": "r", "match": {"severity": "critcal"}}, "match severity 'critcal'"),
        ({"receiver": "r", "match": {"rule": "gpu_lsot"}}, "match rule 'gpu_lsot'"),
        (
            {"receiver": "r", "rules": ["gpu_lost"], "match": {"rule": "gpu_xid"}},
            "can never match",
        ),
        ({"receiver": "r", "match": {"stage": "stoped"}}, "match stage 'stoped'"),
    ],
)
def test_route_match_values_no_alert_can_carry_are_refused(
    route: dict[str, Any], says: str
) -> None:
    with pytest.raises(ValidationError, match=says):
        AlertSettings.model_validate({"routes": [route]})
    AlertSettings.model_validate(
        {"routes": [{"receiver": "r", "match": {"severity": "critical", "rule": "gpu_lost"}}]}
    )


def test_a_route_value_typo_stops_the_server_in_one_line_exit_3(tmp_path: Any) -> None:
    path = tmp_path / "gpuwatch.toml"
    path.write_text(
        "[[server.receivers]]\nname = 'oncall'\ntype = 'webhook'\n"
        "url = 'https://hooks.example.com/x'\nsecret = 's'\n"
        "[[server.alerts.routes]]\nreceiver = 'oncall'\nmatch = { severity = 'critcal' }\n"
    )
    result = subprocess.run(
        [sys.executable, "-m", "gpuwatch", "server", "--listen", "127.0.0.1:0"],
        env={
            **os.environ,
            "GPUWATCH_CONFIG": str(path),
            "GPUWATCH_SERVER_DATABASE_URL": f"sqlite:///{tmp_path / 'cli.db'}",
            "GPUWATCH_SERVER_SCHEDULER": "false",
        },
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 3, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "critcal" in result.stderr and "Traceback" not in result.stderr


# L2 ------------------------------------------------------------------------------------


def test_test_receiver_with_a_slash_is_an_unknown_receiver_exit_8() -> None:
    # Port 19501 has no server: the name is refused before anything is sent.
    result = subprocess.run(
        [sys.executable, "-m", "gpuwatch", "alerts", "test-receiver", "x/../y",
         "--server", "http://127.0.0.1:19501", "--token", "t"],
        env={**os.environ, "GPUWATCH_CONFIG": "/dev/null"},
        capture_output=True,
        text=True,
        timeout=60,
    )  # fmt: skip
    assert result.returncode == 8, result.stderr
    assert "no receiver 'x/../y'" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


# L3 ------------------------------------------------------------------------------------


def test_a_resolved_alert_no_longer_says_when_the_gpu_fills_up() -> None:
    firing = (
        "GPU 0 on h1 is 85% full and fills up in about 1.7 min; growing: alice's pid 4"
        " (python x.py) holds 20.0 GiB"
    )
    assert resolved_summary(firing) == (
        "GPU 0 on h1 was 85% full and filling up; growing: alice's pid 4 (python x.py)"
        " holds 20.0 GiB"
    )
    runaway = "pid 4 grows 7.0 GiB/min; the GPU is full in about 4.4 min at this rate"
    assert resolved_summary(runaway) == "pid 4 grows 7.0 GiB/min"

    alert = AlertState(
        fingerprint="f",
        rule="gpu_filling_up_warning",
        labels={"rule": "gpu_filling_up_warning", "hostname": "h1"},
        severity="warning",
        state="firing",
        summary=firing,
        description="",
        culprits=[],
        active_since=T0,
        last_true_at=T0,
        fired_at=T0,
        id=1,
    )
    (resolved,) = advance(
        {"f": alert}, [], AlertSettings.model_validate({}), now=T0 + 3600, sees=lambda labels: True
    )
    assert resolved.state == "resolved" and "fills up in" not in resolved.summary


# L4 ------------------------------------------------------------------------------------


def test_truncation_never_cuts_an_escape_in_half() -> None:
    text = "x" * 10 + "\u202e" * 20
    for limit in range(5, 60):
        out = shorten(text, limit)
        assert len(out) <= limit
        body = out.removesuffix("…")
        # What is left of the escapes is whole ones: \u202e repeated.
        assert body.removeprefix("x" * min(10, len(body))).replace("\\u202e", "") == "", out
    assert cut("ab\\x1bcd", 7) == "ab\\x1b…" and cut("ab\\x1bcd", 5) == "ab…"
    long = slack._section("&amp;" * 10 + "a \\u202e" * 1000)
    assert long["text"]["text"].endswith(("\\u202e…", " …", "a…"))


# L5 ------------------------------------------------------------------------------------


def test_a_huge_retry_after_is_capped(
    database: Database,
    delivery_settings: ServerSettings,  # noqa: F811
    clock: FakeClock,
) -> None:
    """'Retry-After: 86400' paused the endpoint for a day and failed the notification at
    once (its retry past the deadline). Capped, it is tried again within the cap."""
    hook = Hook()
    hook.up, hook.retry_after = False, "86400"
    engine = engine_of(clock, receiver("webhook", hook, clock, name="hook"))
    _fire(database, _labels())
    _run_until(engine, database, delivery_settings, clock, T0, T0)
    with database.reader() as session:
        (row,) = session.scalars(select(NotificationRow)).all()
    assert row.status == "pending"
    assert row.next_attempt_at <= T0 + RETRY_AFTER_CAP_SECONDS + 1
    hook.up = True
    _run_until(
        engine, database, delivery_settings, clock, T0 + 60, T0 + RETRY_AFTER_CAP_SECONDS + 60
    )
    assert [status for status, _ in hook.answers] == [429, 200]


# L6 ------------------------------------------------------------------------------------


def test_alerts_list_cuts_the_command_and_json_keeps_it_whole() -> None:
    command = "python train.py " + "--flag " * 500
    alert = AlertOut(
        id=1,
        rule="runaway_process",
        state="firing",
        severity="warning",
        labels={"hostname": "h1", "gpu": "0"},
        summary="s",
        description="",
        culprits=[CulpritOut(pid=4, user="alice", command=command, memory_bytes=2**30)],
        active_since=T0,
        starts_at=T0,
        ends_at=None,
        silenced_by=[],
    )
    (row,) = _alert_rows(alert)
    assert len(row[-1]) <= 80 and row[-1].startswith("python train.py --flag")
    assert json.loads(alert.model_dump_json())["culprits"][0]["command"] == command


# L7 ------------------------------------------------------------------------------------


def test_runs_not_started_because_the_last_one_still_runs_are_counted() -> None:
    stats = ServerStats()
    stats.expect_jobs(["alerts"])
    listener = count_busy(stats)
    listener(JobSubmissionEvent(EVENT_JOB_MAX_INSTANCES, "alerts", "default", [T0]))
    listener(JobSubmissionEvent(EVENT_JOB_MAX_INSTANCES, "alerts", "default", [T0 + 15]))
    assert stats.snapshot()["job_runs"][("alerts", "busy")] == 2
