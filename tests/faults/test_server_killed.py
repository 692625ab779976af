"""The server SIGKILLed between sending a notification and recording it, for real.

A real ``gpuwatch server`` process runs its scheduler and alert engine (evaluation
every 0.2 s, no group wait) with a signed webhook receiver pointed at a local endpoint
(``killing_webhook.py``). A snapshot with a lost GPU makes ``gpu_lost`` fire; on
receiving the notification the endpoint SIGKILLs the server, before answering or
after answering (the answer on the wire, never read). A fresh server then starts on
the same database (a SQLite file; a Postgres schema of the shared ``test`` database).

The promise (docs/alerts.md, "Delivery promises"): the row was leased in its own
commit before the POST, so the fresh server leaves it alone while the lease runs; when
the lease ends it sends it once more and records it ``sent``: two deliveries of the
same signed body, at most one duplicate, none lost. The lease is the
``delivery_lease`` setting, here a few seconds (it must exceed 3 x the receiver's
timeout), so the whole story runs for real: the second POST may not arrive before
the lease the killed server wrote.
"""

from __future__ import annotations

import hmac
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from server.factories import body, gpu, process, snapshot
from server.harness import make_token
from sqlalchemy import select

from faults.central import PostgresSchema
from faults.killing_webhook import When, killing_webhook
from faults.server_process import ServerProcess, wait_for
from gpuwatch.server.alerts.models import AlertRow, NotificationRow
from gpuwatch.server.database import Database, create_database
from gpuwatch.server.notifications.receivers.webhook import SIGNATURE_HEADER, sign

HOST = "host-1"
SECRET = "killed-server-secret"
# Long enough that the fresh server runs its alerts job a few times inside it even on a
# slow machine (the test does not depend on that), short enough to wait for.
LEASE = 6


def config(tmp_path: Path, hook_url: str) -> Path:
    """The shortest timers the settings allow that still mean something: rules every
    0.2 s, a new group notified at once; resolutions not sent (only the firing one
    counts here)."""
    path = tmp_path / "gpuwatch.toml"
    path.write_text(
        f"""
[server.alerts]
evaluation_interval = "0.2s"
group_wait = "0s"
delivery_lease = "{LEASE}s"

[[server.receivers]]
name = "hook"
type = "webhook"
url = "{hook_url}"
secret = "{SECRET}"
send_resolved = false
timeout_seconds = 1
"""
    )
    return path


# Both kill points on SQLite; on Postgres the later one (the answer already sent), as
# the server leaves the same row behind either way and each case costs ~5 s.
CASES = [
    ("sqlite", "before_answering"),
    ("sqlite", "after_answering"),
    pytest.param("postgres", "after_answering", marks=pytest.mark.postgres),
]


@pytest.fixture
def database_url(request: pytest.FixtureRequest, tmp_path: Path, kind: str) -> str:
    if kind == "sqlite":
        return f"sqlite:///{tmp_path / 'central.db'}"
    schema: PostgresSchema = request.getfixturevalue("postgres_schema")
    return schema.url()


@pytest.fixture
def database(database_url: str) -> Iterator[Database]:
    db = create_database(database_url)
    yield db
    db.dispose()


def notification_rows(database: Database) -> list[NotificationRow]:
    with database.reader() as session:
        return list(session.scalars(select(NotificationRow)).all())


def alert_runs(server: ServerProcess) -> float:
    """How many alert runs (evaluate, then deliver) the server has completed."""
    return server.metric("gpuwatch_server_job_runs_total", scheduled_job="alerts", result="ok")


def alert_runs_after(server: ServerProcess, runs: float) -> float | None:
    """The server's count of completed alert runs, once it is past ``runs``."""
    now = alert_runs(server)
    return now if now > runs else None


@pytest.mark.parametrize(("kind", "when"), CASES)
def test_killed_between_sending_and_recording_sends_once_more_and_never_twice_more(
    kind: str, when: When, database_url: str, database: Database, tmp_path: Path
) -> None:
    with killing_webhook(when) as hook:
        settings = config(tmp_path, hook.url)
        first = ServerProcess(tmp_path, database_url, name="first", config=settings)
        hook.victim = first.pid
        try:
            fire_gpu_lost(first, database)
            wait_for(lambda: first.process.poll() is not None, "the endpoint to kill the server")
        finally:
            first.kill()
        assert hook.killed == first.pid and first.process.returncode == -9
        assert hook.count() == 1

        # What the killed server left: the row leased (attempted once, not due again
        # for the lease), not recorded.
        (leased,) = notification_rows(database)
        assert leased.status == "pending" and leased.attempts == 1 and leased.sent_at is None
        killed_at = hook.posts[0].at
        assert killed_at + LEASE - 1 < leased.next_attempt_at <= killed_at + LEASE + 1

        second = ServerProcess(tmp_path, database_url, name="second", config=settings)
        try:
            # The lease holds across the restart: the fresh server sends it again only
            # once the killed one's lease has run out.
            wait_for(lambda: hook.count() >= 2, "the notification sent again")
            assert hook.posts[1].at >= leased.next_attempt_at - 0.05  # clocks: one host
            wait_for(lambda: notification_rows(database)[0].status == "sent", "it recorded")
            runs = alert_runs(second)
            wait_for(lambda: alert_runs_after(second, runs + 2), "more alert runs")
            sent = second.metric(
                "gpuwatch_server_notifications_total", receiver="hook", outcome="sent"
            )
            errors = second.errors()
        finally:
            second.stop()

    assert hook.count() == 2  # ≤ 1 duplicate, 0 lost
    assert sent == 1
    (row,) = notification_rows(database)
    assert row.status == "sent" and row.attempts == 2 and row.last_error is None
    # The same notification both times: the stored body, signed the same way.
    first_post, again = hook.posts
    assert first_post.raw == again.raw
    for post in hook.posts:
        assert hmac.compare_digest(post.headers[SIGNATURE_HEADER], sign(post.raw, SECRET))
    assert [a["rule"] for a in again.body()["alerts"]] == ["gpu_lost"]
    with database.reader() as session:
        assert session.scalars(select(AlertRow.state)).all() == ["firing"]
    assert errors == [] and first.errors() == []


def fire_gpu_lost(server: ServerProcess, database: Database) -> None:
    """Push one real snapshot, over HTTP, in which GPU 0 fell off the bus."""
    token = make_token(database, HOST, time.time())
    lost = gpu(0, lost=True, memory_used_bytes=None, memory_free_bytes=None)
    snap = snapshot(1, [lost, gpu(1, [process(101)])], hostname=HOST, at=time.time())
    response = httpx.post(
        f"{server.url}/api/v1/snapshots",
        json=body(snap),
        headers={"Authorization": f"Bearer {token}"},
        timeout=30,
    )
    assert response.status_code == 200, response.text
