"""What a local user flooding the agent's port can make it hold: bounded threads,
bounded queues, a per-user rate limit on OOM incidents, and a head limit that is one.

Real HTTP on loopback; the event sender talks to a real local server or to a post
function the test controls, and its waits are recorded, never slept.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from agent.answering import answering
from agent.test_exporter import _exporter, _port
from gpuwatch.agent.exporter import Exporter, PosterRateLimit
from gpuwatch.agent.http_post import Reply, Unreachable
from gpuwatch.agent.port import MAX_HEAD_BYTES, PortPolicy
from gpuwatch.agent.push import MAX_QUEUED_OOMS, EventSender, ServerSink
from gpuwatch.settings import AgentSettings, load
from gpuwatch.wire import INCIDENTS_OOM_PATH, OomIncident, ReportedEvent

NOW = 1_700_010_100.0
STORED = b'{"id": 1, "duplicate": false}'


def _event(kind: str, pid: int) -> ReportedEvent:
    return ReportedEvent(kind=kind, hostname="gpu-box", pid=pid, summary="s", occurred_at=NOW)  # type: ignore[arg-type]


class Waits(list[float]):
    """The sender's waits between tries, recorded and never slept; never closing."""

    def __call__(self, seconds: float) -> bool:
        self.append(seconds)
        return False


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def limited() -> Iterator[tuple[Exporter, FakeClock, list[OomIncident]]]:
    clock = FakeClock()
    received: list[OomIncident] = []
    exp = _exporter(
        PortPolicy(), on_oom=received.append, oom_posts=PosterRateLimit(burst=3, clock=clock)
    )
    yield exp, clock, received
    exp.stop()


def test_a_users_oom_posts_past_the_burst_get_429_until_the_bucket_refills(limited) -> None:
    exp, clock, received = limited
    url = exp.url + INCIDENTS_OOM_PATH
    body = {"pid": 1, "message": "CUDA out of memory"}
    assert [httpx.post(url, json=body).status_code for _ in range(3)] == [202, 202, 202]
    refused = httpx.post(url, json=body)
    assert refused.status_code == 429
    assert refused.headers["retry-after"] == "6"  # one post every 6 s
    assert refused.headers["connection"] == "close"  # its body was never read
    assert len(received) == 3
    clock.now += 6
    assert httpx.post(url, json=body).status_code == 202
    assert httpx.post(url, json=body).status_code == 429
    assert len(received) == 4


def test_the_rate_limit_is_per_poster_uid() -> None:
    clock = FakeClock()
    limit = PosterRateLimit(burst=1, clock=clock, max_posters=2)
    assert limit.take(1001) is None and limit.take(1002) is None
    assert limit.take(1001) == pytest.approx(6.0)  # 1001's own bucket is empty
    assert limit.take(None) is None  # a poster the kernel did not name: one bucket
    assert limit.refused_total == 1


def test_events_go_out_from_one_thread_and_the_oldest_ooms_are_dropped_past_the_bound() -> None:
    entered, release = threading.Event(), threading.Event()
    sent: list[int] = []

    def slow_server(body: bytes) -> Reply:
        entered.set()
        release.wait(10)  # the server hangs until the test lets it answer
        sent.append(ReportedEvent.model_validate_json(body).pid)
        return Reply(201, _headers(), STORED)

    sender = EventSender(slow_server)
    before = threading.active_count()
    first = sender.submit(_event("oom", 0))
    assert entered.wait(10)  # in flight: the rest queue behind it
    deliveries = [sender.submit(_event("oom", pid)) for pid in range(1, 201)]
    assert threading.active_count() <= before + 1  # one sender, however many posts
    # One in flight, MAX_QUEUED_OOMS waiting: the rest (the oldest) were dropped.
    assert sender.dropped == {("oom", "queue_full"): 200 - MAX_QUEUED_OOMS}
    assert not any(d.pending or d.delivered for d in deliveries[: 200 - MAX_QUEUED_OOMS])
    release.set()
    sender.close(timeout_seconds=10)
    assert first.delivered and all(d.delivered for d in deliveries[-MAX_QUEUED_OOMS:])
    assert sent == [0, *range(201 - MAX_QUEUED_OOMS, 201)]


def test_reaped_events_go_first_and_are_retried_after_retry_after_until_stored() -> None:
    answers = iter([429, 429, 503, 201, 201])
    waits = Waits()
    sent: list[str] = []
    entered, gate = threading.Event(), threading.Event()

    def server(body: bytes) -> Reply:
        entered.set()
        gate.wait(10)
        sent.append(ReportedEvent.model_validate_json(body).kind)
        status = next(answers)
        return Reply(status, _headers({"Retry-After": "7"} if status == 429 else {}), STORED)

    sender = EventSender(server, wait=waits)
    blocker = sender.submit(_event("oom", 1))  # holds the sender while the rest queue
    assert entered.wait(10)
    warning = sender.submit(_event("reaped", 2))
    gate.set()
    warning.join(10)
    blocker.join(10)
    # The OOM in flight got 429 twice (Retry-After: 7) and a 503 (backoff 2 x 3 tries):
    # it gave up after 3 tries; the warning, queued behind it, went next and was stored.
    assert not blocker.delivered and warning.delivered
    assert waits == [7.0, 7.0]
    assert sent == ["oom", "oom", "oom", "reaped"]


def test_a_reaped_event_is_retried_past_the_oom_attempts_and_a_refusal_is_final() -> None:
    answers = iter([503] * 5 + [201] + [422])
    waits = Waits()

    def server(body: bytes) -> Reply:
        return Reply(next(answers), _headers(), STORED)

    sender = EventSender(server, wait=waits)
    stored = sender.submit(_event("reaped", 1))
    stored.join(10)
    assert stored.delivered and waits == [2.0, 4.0, 6.0, 8.0, 10.0]
    refused = sender.submit(_event("reaped", 2))
    refused.join(10)
    assert not refused.pending and not refused.delivered  # 422: asking again is no use
    assert sender.dropped == {("reaped", "given_up"): 1}  # exported, not only logged


def test_the_server_sink_sends_through_its_one_sender(tmp_path: Path) -> None:
    with answering(lambda r: (201, STORED)) as server:
        settings = load(AgentSettings, server_url=server.url, token="t0ken", spool_dir=tmp_path)
        sink = ServerSink(settings)
        deliveries = [sink.send_event(_event("oom", pid)) for pid in range(3)]
        for delivery in deliveries:
            delivery.join(10)
        sink.stop()
        sink.reporter.close()
    assert all(d.delivered for d in deliveries)
    assert len(server.received) == 3


def test_an_unreachable_server_is_retried_then_given_up_for_an_oom() -> None:
    def away(body: bytes) -> Reply:
        raise Unreachable("connection refused")

    waits = Waits()
    sender = EventSender(away, wait=waits)
    delivery = sender.submit(_event("oom", 1))
    delivery.join(10)
    assert not delivery.delivered and waits == [2.0, 4.0]
    assert sender.dropped == {("oom", "given_up"): 1}


# -- the port's own hygiene -------------------------------------------------------------------


def test_a_head_over_the_limit_gets_431_and_the_connection_closes() -> None:
    exp = _exporter(PortPolicy())
    try:
        with socket.create_connection(("127.0.0.1", _port(exp)), timeout=5) as conn:
            start = b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nX-Pad: "
            # Exactly the limit and no end of head yet: all of it read, none served.
            conn.sendall(start + b"a" * (MAX_HEAD_BYTES - len(start)))
            answer = _read_all(conn)
        assert answer.startswith(b"HTTP/1.1 431 ")
    finally:
        exp.stop()


def test_a_post_without_a_length_gets_411_and_its_unread_body_is_not_a_request() -> None:
    exp = _exporter(PortPolicy(), on_oom=lambda incident: None)
    try:
        with socket.create_connection(("127.0.0.1", _port(exp)), timeout=5) as conn:
            smuggled = b"GET /healthz HTTP/1.1\r\nHost: localhost\r\n\r\n"
            conn.sendall(
                b"POST /incidents/oom HTTP/1.1\r\nHost: localhost\r\n"
                b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
                + f"{len(smuggled):x}\r\n".encode()
                + smuggled
                + b"\r\n0\r\n\r\n"
            )
            answer = _read_all(conn)
        assert answer.startswith(b"HTTP/1.1 411 ")
        assert answer.count(b"HTTP/1.1 ") == 1  # closed: the chunk was not served
    finally:
        exp.stop()


def test_pipelined_requests_are_each_answered_under_the_head_rules() -> None:
    exp = _exporter(PortPolicy())
    try:
        with socket.create_connection(("127.0.0.1", _port(exp)), timeout=5) as conn:
            one = b"GET /nope HTTP/1.1\r\nHost: localhost\r\n\r\n"
            last = b"GET /nope HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
            conn.sendall(one + one + last)
            answer = _read_all(conn)
        assert answer.count(b"HTTP/1.1 404 ") == 3
    finally:
        exp.stop()


def _read_all(conn: socket.socket) -> bytes:
    chunks = []
    while chunk := conn.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


def _headers(values: dict[str, str] | None = None):  # type: ignore[no-untyped-def]
    from email.message import Message

    message = Message()
    for key, value in (values or {}).items():
        message[key] = value
    return message
