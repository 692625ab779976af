"""Slack answering 429 and 500 for ten minutes, then recovering.

Real parts: snapshots through the real ingest into SQLite, the real alert engine and
the real Slack receiver posting over HTTP to a local stand-in (``slack_stub``). Time is
injected: the engine runs every evaluation interval of a fake clock, so ten minutes of
refusals take a few hundred milliseconds. Two hosts lose a GPU, so two notifications
are due; each must reach Slack exactly once, after the outage, with every retry
waiting at least the ``Retry-After`` Slack asked for, and none given up.
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import pairwise
from pathlib import Path
from typing import Any

import httpx
import pytest
from server.factories import T0, gpu, process, snapshot
from server.harness import make_token
from sqlalchemy import select, text
from support.clock import FakeClock

from faults.slack_stub import OK, SERVER_ERROR, Answer, rate_limited, slack
from gpuwatch.server.alerts.engine import BACKOFF_CAP_SECONDS, AlertEngine
from gpuwatch.server.alerts.models import NotificationRow
from gpuwatch.server.database import Database, create_database
from gpuwatch.server.database.migrate import upgrade
from gpuwatch.server.ingest.service import ingest_snapshots
from gpuwatch.server.notifications.config import ReceiverConfig
from gpuwatch.server.notifications.receivers.base import build_receiver
from gpuwatch.settings import ServerSettings
from gpuwatch.wire import IngestRequest

OUTAGE = 600.0  # Slack refuses for the first ten minutes
EVALUATION = 15.0
RETRY_AFTER = 30


@pytest.fixture
def database(tmp_path: Path) -> Iterator[Database]:
    db = create_database(f"sqlite:///{tmp_path / 'central.db'}")
    upgrade(db)
    yield db
    db.dispose()


@pytest.fixture
def settings(tmp_path: Path) -> ServerSettings:
    return ServerSettings.model_validate(
        {
            "data_dir": tmp_path,
            "database_url": f"sqlite:///{tmp_path / 'central.db'}",
            "scheduler": False,
            "alerts": {"group_wait": "30s", "group_interval": "5m", "repeat_interval": "4h"},
        }
    )


def lose_a_gpu(
    database: Database, settings: ServerSettings, host: str, at: float, *, sequence: int = 1
) -> None:
    """One snapshot of ``host`` in which GPU 0 has fallen off the bus (``gpu_lost``)."""
    if sequence == 1:
        make_token(database, host)
    gpus = [gpu(0, lost=True, memory_used_bytes=None, memory_free_bytes=None), gpu(1, [process(7)])]
    with database.writer() as session, session.begin():
        host_id = session.scalar(text("SELECT id FROM hosts WHERE hostname = :h"), {"h": host})
        ingest_snapshots(
            session=session,
            dialect=database.dialect,
            host_id=host_id,
            request=IngestRequest(snapshots=[snapshot(sequence, gpus, hostname=host, at=at)]),
            settings=settings,
            now=at,
        )


def outage_then_ok(at: float, _body: bytes) -> Answer:
    """429 (Retry-After 30 s) and 500 by turns for ten minutes, then 200 ok."""
    if at >= T0 + OUTAGE:
        return OK
    return rate_limited(RETRY_AFTER) if int(at) // 60 % 2 == 0 else SERVER_ERROR


def test_slack_down_for_ten_minutes_gets_each_notification_once_after_it(
    database: Database, settings: ServerSettings
) -> None:
    clock = FakeClock(T0)
    client = httpx.Client()
    with slack(clock) as stub:
        stub.answer = outage_then_ok
        engine = _engine(stub.url, client, clock)
        lose_a_gpu(database, settings, "host-1", T0)
        lose_a_gpu(database, settings, "host-2", T0)
        end = T0 + OUTAGE + 300
        while clock.now <= end:
            engine.run(database=database, settings=settings, now=clock.now)
            clock.now = max(clock.now, _next_tick(clock.now))
        client.close()
        posts = list(stub.posts)
    with database.reader() as session:
        rows = session.scalars(select(NotificationRow)).all()

    by_host = _by_host(posts)
    assert set(by_host) == {"host-1", "host-2"}
    for host, attempts in by_host.items():
        delivered = [p for p in attempts if p.status == 200]
        assert len(delivered) == 1, f"{host}: {len(delivered)} messages delivered"
        assert attempts[-1] is delivered[0]  # nothing sent after the one that landed
        assert all(p.at < T0 + OUTAGE for p in attempts[:-1])
        assert delivered[0].at >= T0 + OUTAGE
        assert delivered[0].at <= T0 + OUTAGE + BACKOFF_CAP_SECONDS * 1.5 + EVALUATION
        _check_backoff(attempts)
        assert len(attempts) <= 20, "Slack was hammered"
    assert sorted(r.status for r in rows) == ["sent", "sent"]
    assert all(r.last_error is None and r.sent_at is not None for r in rows)
    # Slack's pace: one message a second at most, to the one webhook.
    times = sorted(p.at for p in posts)
    assert all(b - a >= 1.0 for a, b in pairwise(times))


def test_a_429_pauses_every_notification_to_that_webhook(
    database: Database, settings: ServerSettings
) -> None:
    """Slack's limit is per webhook URL: after its 429 asked for 30 s, the other
    notifications due to the same webhook wait too (before, four more were posted and
    refused within seconds, then all five again at once)."""
    clock = FakeClock(T0)
    client = httpx.Client()
    with slack(clock) as stub:
        stub.answer = lambda at, _body: rate_limited(RETRY_AFTER) if at < T0 + 90 else OK
        engine = _engine(stub.url, client, clock)
        hosts = [f"host-{n}" for n in range(1, 6)]
        for host in hosts:
            lose_a_gpu(database, settings, host, T0)
        while clock.now <= T0 + 600:
            engine.run(database=database, settings=settings, now=clock.now)
            clock.now = max(clock.now, _next_tick(clock.now))
        client.close()
        posts = list(stub.posts)
    refused = [p for p in posts if p.status == 429]
    assert refused, "Slack never answered 429"
    for post in refused:
        during = [p for p in posts if post.at < p.at < post.at + RETRY_AFTER]
        assert during == [], f"{len(during)} posts while Slack asked to wait"
    delivered = sorted(h for p in posts if p.status == 200 for h in hosts if h in p.text)
    assert delivered == hosts  # each host's group once, after the pause


def test_a_notification_given_up_at_its_deadline_is_told_again_once_the_receiver_is_back(
    database: Database, settings: ServerSettings
) -> None:
    """The webhook answers 503 for 75 minutes, past the one-hour delivery deadline, while
    a GPU stays lost (the agent keeps pushing). Before, the group counted as told when
    its notification was planned: the receiver heard nothing until repeat_interval
    (4 h), 166 minutes after it came back."""
    clock = FakeClock(T0)
    client = httpx.Client()
    down_for = 75 * 60.0
    with slack(clock) as stub:
        stub.answer = lambda at, _body: SERVER_ERROR if at < T0 + down_for else OK
        engine = _engine(stub.url, client, clock)
        sequence = 0
        while clock.now <= T0 + down_for + 900:
            sequence += 1
            lose_a_gpu(database, settings, "host-1", clock.now, sequence=sequence)
            engine.run(database=database, settings=settings, now=clock.now)
            clock.now = max(clock.now, _next_tick(clock.now))
        client.close()
        posts = list(stub.posts)
    delivered = [p for p in posts if p.status == 200]
    assert delivered, "nothing reached the receiver after it came back"
    # Told again at the group's next look after the give-up (group_interval 5 m).
    assert delivered[0].at <= T0 + down_for + 360, delivered[0].at - T0
    assert len(delivered) == 1


def _engine(url: str, client: httpx.Client, clock: FakeClock) -> AlertEngine:
    """The real engine with one Slack receiver, ``ops``, posting to ``url``; waits on
    the fake clock, backoff jitter fixed at 1x."""
    receiver = build_receiver(
        ReceiverConfig(name="ops", type="slack", url=url), client=client, clock=clock
    )
    return AlertEngine(
        receivers={"ops": receiver}, clock=clock, sleep=clock.advance, rng=lambda: 0.5
    )


def _next_tick(now: float) -> float:
    return T0 + ((now - T0) // EVALUATION + 1) * EVALUATION


def _by_host(posts: list[Any]) -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = {}
    for post in posts:
        host = "host-1" if "host-1" in post.text else "host-2"
        assert host in post.text
        out.setdefault(host, []).append(post)
    return out


def _check_backoff(attempts: list[Any]) -> None:
    """Every retry waits at least what Slack asked for (429), or the engine's backoff
    (500): 2^(n-1) seconds after the n-th attempt, capped (the jitter is fixed at 1x)."""
    after_500 = 0
    for n, (before, after) in enumerate(pairwise(attempts), start=1):
        gap = after.at - before.at
        if before.status == 429:
            assert before.retry_after == RETRY_AFTER
            assert gap >= RETRY_AFTER, f"retried {gap:.0f}s after a 429 asking for {RETRY_AFTER}s"
        else:
            assert before.status == 500
            assert gap >= min(BACKOFF_CAP_SECONDS, 2.0 ** (n - 1))
            after_500 += 1
    assert after_500, "the outage never answered 500 to this notification"


def test_slack_answers_are_judged_as_slack_documents_them(database: Database) -> None:
    # The three answers of the outage, each on its own, through the real receiver.
    clock = FakeClock(T0)
    client = httpx.Client()
    with slack(clock) as stub:
        receiver = build_receiver(
            ReceiverConfig(name="ops", type="slack", url=stub.url), client=client, clock=clock
        )
        engine = AlertEngine(receivers={"ops": receiver}, clock=clock, sleep=clock.advance)
        outcomes = []
        for answer in (rate_limited(RETRY_AFTER), SERVER_ERROR, OK):
            stub.answer = lambda _at, _body, a=answer: a  # type: ignore[misc]
            outcomes.append(engine.test_receiver(database=database, name="ops"))
        client.close()
    assert [o.outcome for o in outcomes] == ["retry", "retry", "sent"]
    assert outcomes[0].retry_after == RETRY_AFTER
    assert stub.url not in " ".join(o.detail for o in outcomes)  # the webhook is a credential
