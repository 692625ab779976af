"""What the agent does with each kind of answer to a push, over real loopback HTTP.

Only a gpuwatch ingest answer settles spooled snapshots: a 2xx from something else (a
proxy's HTML page, another service's JSON) keeps them, backs off and says so once. A
renamed host's snapshots of its old name are dropped, counted, before they can block
the queue. Whatever the server says is escaped before the log shows it.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from pydantic import SecretStr
from support.clock import FakeClock

from agent.answering import Received, answering
from gpuwatch.agent.reporter import Reporter
from gpuwatch.settings import AgentSettings
from gpuwatch.snapshot import HostSnapshot
from gpuwatch.wire import OTHER_HOST_DETAIL

EPOCH = 1_700_000_000.0
CONTROL = "\x1b[2J\x00\r\n\x07"


@dataclass(frozen=True)
class Answer:
    status: int
    body: bytes
    content_type: str = "application/json"


@dataclass
class Server:
    url: str
    answer: Callable[[dict[str, Any]], Answer]
    bodies: list[dict[str, Any]] = field(default_factory=list)


def ingest_answer(request: dict[str, Any]) -> Answer:
    """What a gpuwatch server answers when it stores every snapshot sent."""
    sent = len(request["snapshots"])
    body = {"accepted": sent, "duplicate": 0, "results": ["accepted"] * sent}
    return Answer(200, json.dumps(body).encode())


@contextmanager
def serving(answer: Callable[[dict[str, Any]], Answer]) -> Iterator[Server]:
    """A loopback HTTP server answering each POST with ``server.answer`` (changeable)."""
    server = Server("", answer)

    def reply(got: Received) -> tuple[int, bytes, str]:
        request = json.loads(got.body)
        server.bodies.append(request)
        answered = server.answer(request)
        return answered.status, answered.body, answered.content_type

    with answering(reply) as http:
        server.url = http.url
        yield server


def settings(url: str, spool_dir: Path) -> AgentSettings:
    return AgentSettings(server_url=url, token=SecretStr("gwt_token"), spool_dir=spool_dir)


def reporter(url: str, spool_dir: Path, clock: FakeClock) -> Reporter:
    return Reporter(
        settings(url, spool_dir), clock=clock, rand=lambda: 1.0, wall_clock=lambda: EPOCH
    )


def snapshot(sequence: int, hostname: str = "gpu-1") -> HostSnapshot:
    return HostSnapshot(
        agent_id="agent-1",
        hostname=hostname,
        boot_id="boot-1",
        sequence=sequence,
        collected_at=EPOCH + sequence,
        gpus=[],
    )


def reporter_lines(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "gpuwatch.agent.reporter"]


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(0.0)


# --- a 2xx that is not the server speaking ------------------------------------------------

NOT_INGEST_ANSWERS = {
    "html": Answer(200, b"<html><body>Welcome to nginx!</body></html>", "text/html"),
    "other json": Answer(200, b'{"hello": "world"}'),
    "json array": Answer(200, b'[{"accepted": 1, "duplicate": 0}]'),
    "counts as strings": Answer(200, b'{"accepted": "1", "duplicate": "0"}'),
    "counts as booleans": Answer(200, b'{"accepted": true, "duplicate": false}'),
    "empty": Answer(204, b""),
    "not utf-8": Answer(200, b"\xff\xfe{}"),
}


@pytest.mark.parametrize("kind", list(NOT_INGEST_ANSWERS))
def test_a_2xx_that_is_not_an_ingest_answer_keeps_the_snapshots_and_warns_once(
    kind: str, tmp_path: Path, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="gpuwatch")
    with serving(lambda _: NOT_INGEST_ANSWERS[kind]) as server:
        pusher = reporter(server.url, tmp_path / "spool", clock)
        try:
            for sequence in range(3):
                pusher.offer(snapshot(sequence))
                result = pusher.drain_once()
                assert result.stopped_by == "unexpected_status"
                assert result.retry_in_seconds and result.retry_in_seconds > 0
                assert pusher.drain_once().stopped_by == "backoff"  # it waits: no hammering
                clock.advance(result.retry_in_seconds)
            stats = pusher.stats()
            assert stats.pending == 3 and stats.pushed_total == {} and stats.dropped_total == {}
            assert stats.batches_total == {"unexpected_status": 3}
            warnings = reporter_lines(caplog)
            assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING
            assert "not a gpuwatch ingest answer" in warnings[0].getMessage()

            server.answer = ingest_answer  # server_url fixed: the same snapshots go through
            result = pusher.drain_once()
        finally:
            pusher.close()
    assert (result.stopped_by, result.delivered, result.pending) == (None, 3, 0)
    assert [s["sequence"] for s in server.bodies[-1]["snapshots"]] == [0, 1, 2]
    assert "accepts snapshots again" in reporter_lines(caplog)[-1].getMessage()


def test_the_warning_names_what_answered_escaped(
    tmp_path: Path, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    with serving(lambda _: Answer(200, b"<html/>", f"text/html{CONTROL}")) as server:
        pusher = reporter(server.url, tmp_path / "spool", clock)
        try:
            pusher.offer(snapshot(1))
            pusher.drain_once()
        finally:
            pusher.close()
    (line,) = [r.getMessage() for r in reporter_lines(caplog)]
    assert "HTTP 200 with text/html" in line
    assert not any(ch in line for ch in "\x1b\x00\r\n\x07")


def test_an_older_servers_answer_without_results_still_settles_the_batch(
    tmp_path: Path, clock: FakeClock
) -> None:
    def counts_only(request: dict[str, Any]) -> Answer:
        sent = len(request["snapshots"])
        return Answer(200, json.dumps({"accepted": sent, "duplicate": 0}).encode())

    with serving(counts_only) as server:
        pusher = reporter(server.url, tmp_path / "spool", clock)
        try:
            pusher.offer(snapshot(1))
            pusher.offer(snapshot(2))
            result = pusher.drain_once()
        finally:
            pusher.close()
    assert (result.stopped_by, result.delivered, result.pending) == (None, 2, 0)


# --- a renamed host -------------------------------------------------------------------------


def other_host_refusal(token_host: str) -> Callable[[dict[str, Any]], Answer]:
    """The server's answer to a batch naming a host its token is not (403)."""

    def answer(request: dict[str, Any]) -> Answer:
        names = {s["hostname"] for s in request["snapshots"]}
        if names != {token_host}:
            detail = json.dumps({"detail": OTHER_HOST_DETAIL + token_host}).encode()
            return Answer(403, detail)
        return ingest_answer(request)

    return answer


def spooled_under(spool_dir: Path, hostname: str, sequences: range) -> None:
    """An earlier run's spool: snapshots of ``hostname`` the server never got."""
    earlier = reporter("http://127.0.0.1:9", spool_dir, FakeClock())
    try:
        for sequence in sequences:
            earlier.offer(snapshot(sequence, hostname))
    finally:
        earlier.close()


def test_snapshots_of_the_old_hostname_are_dropped_as_hostname_changed_and_reported(
    tmp_path: Path, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    spool_dir = tmp_path / "spool"
    spooled_under(spool_dir, "oldname", range(0, 3))
    caplog.set_level(logging.INFO, logger="gpuwatch")
    with serving(other_host_refusal("newname")) as server:
        pusher = reporter(server.url, spool_dir, clock)
        try:
            pusher.offer(snapshot(10, "newname"))
            pusher.offer(snapshot(11, "newname"))
            first = pusher.drain_once()
            pusher.offer(snapshot(12, "newname"))
            second = pusher.drain_once()
            stats = pusher.stats()
        finally:
            pusher.close()

    assert (first.stopped_by, first.delivered, first.dropped, first.pending) == (None, 2, 3, 0)
    assert second.stopped_by is None and second.delivered == 1
    assert stats.dropped_total == {"hostname_changed": 3}
    assert stats.pushed_total == {"accepted": 3, "duplicate": 0}
    # Only the renamed host's snapshots went out, and the server heard of the drop.
    assert [[s["sequence"] for s in b["snapshots"]] for b in server.bodies] == [[10, 11], [12]]
    assert [b["spool_dropped_total"] for b in server.bodies] == [3, 3]
    (warning,) = [r for r in reporter_lines(caplog) if r.levelno >= logging.WARNING]
    assert warning.getMessage().startswith("dropped 3 spooled snapshot(s) of hostname 'oldname'")
    assert "now reports hostname 'newname'" in warning.getMessage()


def test_snapshots_of_the_current_hostname_are_never_dropped_for_a_token_of_another(
    tmp_path: Path, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    """Renamed, still with the old name's token: only the operator can fix that. The
    log says how; every snapshot of the current name stays spooled."""
    caplog.set_level(logging.INFO, logger="gpuwatch")
    with serving(other_host_refusal("oldname")) as server:
        pusher = reporter(server.url, tmp_path / "spool", clock)
        try:
            for sequence in range(4):
                pusher.offer(snapshot(sequence, "newname"))
                result = pusher.drain_once()
                assert result.stopped_by == "auth_failed"
                clock.advance(result.retry_in_seconds or 0.0)
            stats = pusher.stats()
        finally:
            pusher.close()
    assert stats.pending == 4 and stats.dropped_total == {} and stats.auth_failed
    (error,) = [r for r in reporter_lines(caplog) if r.levelno >= logging.WARNING]
    assert error.levelno == logging.ERROR
    message = error.getMessage()
    assert "HTTP 403: this token belongs to host oldname" in message
    assert "reports hostname 'newname'" in message
    assert "gpuwatch token create newname" in message
    assert 'hostname = "oldname"' in message
    assert "refused the agent token" not in message


def test_nothing_is_dropped_before_the_agent_has_said_its_hostname(
    tmp_path: Path, clock: FakeClock
) -> None:
    spool_dir = tmp_path / "spool"
    spooled_under(spool_dir, "oldname", range(2))
    with serving(ingest_answer) as server:
        pusher = reporter(server.url, spool_dir, clock)
        try:
            result = pusher.drain_once()  # no offer yet: what the spool holds is sent
        finally:
            pusher.close()
    assert (result.delivered, result.dropped) == (2, 0)


def test_the_push_thread_waits_for_the_first_offer_before_sending_an_old_spool(
    tmp_path: Path,
) -> None:
    spool_dir = tmp_path / "spool"
    spooled_under(spool_dir, "oldname", range(2))
    delivered = threading.Event()

    def answer(request: dict[str, Any]) -> Answer:
        delivered.set()
        return ingest_answer(request)

    with serving(answer) as server:
        pusher = Reporter(settings(server.url, spool_dir))
        try:
            pusher.start()
            assert not delivered.wait(0.3)  # the old spool waits for the current name
            pusher.offer(snapshot(5, "newname"))
            assert delivered.wait(5)
        finally:
            pusher.close()
    assert [[s["sequence"] for s in b["snapshots"]] for b in server.bodies] == [[5]]
    assert pusher.stats().dropped_total == {"hostname_changed": 2}


# --- whatever the server says is escaped in the log --------------------------------------------


@pytest.mark.parametrize("status", [401, 403, 418, 500])
def test_the_servers_detail_is_logged_escaped_and_cut(
    status: int, tmp_path: Path, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    detail = f"unknown or revoked token{CONTROL}2026-01-01 INFO gpuwatch: all good" + "x" * 500
    with serving(lambda _: Answer(status, json.dumps({"detail": detail}).encode())) as server:
        pusher = reporter(server.url, tmp_path / "spool", clock)
        try:
            pusher.offer(snapshot(1))
            pusher.drain_once()
        finally:
            pusher.close()
    (line,) = [r.getMessage() for r in reporter_lines(caplog)]
    assert f"HTTP {status}: unknown or revoked token\\x1b[2J\\x00\\r\\n\\x07" in line
    assert not any(ch in line for ch in "\x1b\x00\r\n\x07")
    assert len(line) < 500


@contextmanager
def raw_answering(reply: bytes) -> Iterator[str]:
    """A TCP server that reads a request and answers ``reply`` verbatim (not HTTP)."""
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve() -> None:
        listener.settimeout(0.05)
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            with conn:
                conn.recv(65536)
                conn.sendall(reply)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        thread.join()
        listener.close()


def test_a_malformed_status_line_reaches_the_log_escaped(
    tmp_path: Path, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    forged = b"\x1b[2J\x00FAKE\r\n2026-01-01 00:00:00,000 INFO gpuwatch: all good\r\n\r\n"
    with raw_answering(forged) as url:
        pusher = reporter(url, tmp_path / "spool", clock)
        try:
            pusher.offer(snapshot(1))
            result = pusher.drain_once()
        finally:
            pusher.close()
    assert result.stopped_by == "unreachable" and result.pending == 1
    (line,) = [r.getMessage() for r in reporter_lines(caplog)]
    assert "\\x1b[2J\\x00FAKE" in line
    assert not any(ch in line for ch in "\x1b\x00\r\n")
