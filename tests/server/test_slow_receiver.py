"""A receiver that answers slowly cannot hold up alerting.

The endpoint is a real local HTTP server that answers ``200 OK`` at once, then sends
its body a byte at a time, each byte well inside httpx's (per-read) timeout: before,
one attempt with ``timeout_seconds = 1`` lasted for hours, and with it the alert job
(evaluation and every other receiver). An attempt now ends at its timeout, and one run
gives a receiver only about that much time, handing its backlog to the next run.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from sqlalchemy import select
from support.sink import Sink, sink

from gpuwatch.server.alerts.engine import AlertEngine, sample_notification
from gpuwatch.server.alerts.models import NotificationRow
from gpuwatch.server.database import Database
from gpuwatch.server.notifications.config import ReceiverConfig
from gpuwatch.server.notifications.receivers.base import build_receiver
from server.factories import T0
from server.harness import FakeClock

TIMEOUT = 1.0


def _drip(conn: socket.socket, *, headers_too: bool) -> None:
    try:
        conn.settimeout(30)
        data = b""
        while b"\r\n\r\n" not in data:
            data += conn.recv(65536)
        conn.sendall(b"HTTP/1.1 200 OK\r\n")
        if headers_too:  # never ends its headers
            while True:
                conn.sendall(b"X-Slow: y\r\n")
                time.sleep(0.2)
        conn.sendall(b"Content-Type: text/plain\r\nContent-Length: 100000\r\n\r\n")
        while True:
            conn.sendall(b"o")
            time.sleep(0.2)
    except OSError:
        pass
    finally:
        conn.close()


def dripping_server(*, headers_too: bool = False) -> Iterator[str]:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(
                target=_drip, args=(conn,), kwargs={"headers_too": headers_too}, daemon=True
            ).start()

    threading.Thread(target=serve, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}/hook"
    finally:
        listener.close()


@pytest.fixture
def drip() -> Iterator[str]:
    yield from dripping_server()


@pytest.fixture
def drip_headers() -> Iterator[str]:
    yield from dripping_server(headers_too=True)


@pytest.fixture
def fast(clock: FakeClock) -> Iterator[Sink]:
    with sink(clock) as s:
        yield s


def slow_receiver(url: str, client: httpx.Client, name: str = "slow") -> object:
    config = ReceiverConfig(
        name=name, type="webhook", url=url, secret="s3cret-s3cret", timeout_seconds=TIMEOUT
    )
    return build_receiver(config, client=client)


@pytest.mark.parametrize("where", ["body", "headers"])
def test_an_attempt_ends_at_its_timeout_however_slowly_the_answer_drips(
    where: str, drip: str, drip_headers: str
) -> None:
    url = drip if where == "body" else drip_headers
    with httpx.Client() as client:
        receiver = slow_receiver(url, client)
        started = time.monotonic()
        attempt = receiver.attempt(sample_notification("slow", T0))  # type: ignore[attr-defined]
        took = time.monotonic() - started
    assert attempt.outcome == "retry" and "timed out" in attempt.detail
    assert TIMEOUT * 0.9 <= took < TIMEOUT * 2.5  # the drip lasts far longer than this


def test_a_slow_receiver_holds_a_run_for_about_its_timeout_not_its_backlog(
    database: Database, drip: str, fast: Sink, clock: FakeClock
) -> None:
    with database.writer() as session, session.begin():
        for receiver in ("slow", "fast"):
            for n in range(10):
                session.add(
                    NotificationRow(
                        receiver=receiver,
                        group_key=f"{{n={n}}}",
                        flush_at=T0,
                        status="pending",
                        body=sample_notification(receiver, T0).to_json(),
                        attempts=0,
                        next_attempt_at=T0,
                        deadline_at=T0 + 3600,
                    )
                )
    with httpx.Client() as client:
        fast_config = ReceiverConfig(name="fast", type="webhook", url=fast.url, secret="s3cret-s3")
        engine = AlertEngine(
            receivers={
                "slow": slow_receiver(drip, client),  # type: ignore[dict-item]
                "fast": build_receiver(fast_config, client=client),
            },
            clock=clock,
        )
        started = time.monotonic()
        outcomes = engine.deliver(database=database, now=T0, lease_seconds=120)
        took = time.monotonic() - started

    # 10 attempts of 1 s each before; now one, and the rest wait for the next run.
    assert took < 3 * TIMEOUT
    assert outcomes.count(("fast", "sent")) == 10 and len(fast.deliveries) == 10
    assert outcomes.count(("slow", "retry")) == 1
    with database.reader() as session:
        slow = session.scalars(
            select(NotificationRow).where(NotificationRow.receiver == "slow")
        ).all()
    # The one tried backs off; the others are handed back untried, due at once.
    assert sorted(r.attempts for r in slow) == [0] * 9 + [1]
    assert all(r.next_attempt_at == T0 for r in slow if r.attempts == 0)
    assert all(r.status == "pending" for r in slow)
