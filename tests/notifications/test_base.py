"""The helpers every receiver shares: Retry-After, redaction, the factory, the texts."""

from __future__ import annotations

import httpx
import pytest

from gpuwatch.server.notifications import receivers
from gpuwatch.server.notifications.config import ReceiverConfig
from gpuwatch.server.notifications.model import Culprit, Notification
from gpuwatch.server.notifications.receivers.alertmanager import AlertmanagerReceiver
from gpuwatch.server.notifications.receivers.base import (
    Redactor,
    Reply,
    build_receiver,
    classify,
    parse_retry_after,
)
from gpuwatch.server.notifications.receivers.slack import SlackReceiver
from gpuwatch.server.notifications.receivers.text import culprit_line, format_bytes, format_rate
from gpuwatch.server.notifications.receivers.webhook import WebhookReceiver

NOW = 1_787_000_000.0  # 2026-08-17T20:53:20Z


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        ("120", 120.0),
        (" 3 ", 3.0),
        ("1.5", 1.5),
        ("0", 0.0),
        ("-5", 0.0),
        ("Mon, 17 Aug 2026 20:55:20 GMT", 120.0),
        ("Mon, 17 Aug 2026 20:50:00 GMT", 0.0),  # in the past: now
        ("soon", None),
        ("", None),
        ("nan", None),
        ("inf", None),
        (None, None),
    ],
)
def test_parse_retry_after(value: str | None, seconds: float | None) -> None:
    assert parse_retry_after(value, now=NOW) == seconds


def test_the_redactor_removes_url_path_query_password_and_secret() -> None:
    config = ReceiverConfig(
        name="h",
        type="webhook",
        url="https://user:pw12345@example.com/hooks/abcdefghij?token=qwerty",  # type: ignore[arg-type]
        secret="topsecret",  # type: ignore[arg-type]
    )
    redact = Redactor.for_config(config)
    text = redact(
        "url https://user:pw12345@example.com/hooks/abcdefghij?token=qwerty "
        "path /hooks/abcdefghij seg abcdefghij query token=qwerty pw pw12345 key topsecret"
    )
    for secret in ("pw12345", "abcdefghij", "qwerty", "topsecret"):
        assert secret not in text
    assert text.startswith("url <redacted> path <redacted>")


def _reply(status: int, body: bytes = b"", **headers: str) -> Reply:
    return Reply(status, httpx.Headers(headers), body)


@pytest.mark.parametrize(
    ("status", "outcome"),
    [
        (200, "sent"),
        (299, "sent"),
        (302, "broken"),
        (400, "broken"),
        (404, "broken"),
        (408, "retry"),
        (425, "retry"),
        (429, "retry"),
        (500, "retry"),
        (599, "retry"),
    ],
)
def test_classify(status: int, outcome: str) -> None:
    attempt = classify(_reply(status), label="x", redact=Redactor([]), now=NOW)
    assert (attempt.outcome, attempt.status_code) == (outcome, status)


def test_classify_prefers_the_header_over_the_hint_and_cuts_long_bodies() -> None:
    headed = classify(
        _reply(429, b"x" * 10_000, **{"Retry-After": "7"}),
        label="x",
        redact=Redactor([]),
        now=NOW,
        retry_after=1.0,
    )
    assert headed.retry_after == 7.0
    assert len(headed.detail) < 200
    hinted = classify(_reply(429), label="x", redact=Redactor([]), now=NOW, retry_after=1.0)
    assert hinted.retry_after == 1.0
    message = classify(
        _reply(400, b'{"message":"bad alert\\nline"}'), label="x", redact=Redactor([]), now=NOW
    )
    assert message.detail == "x: HTTP 400 bad alert line"


@pytest.mark.parametrize(
    ("kind", "cls", "interval"),
    [
        ("slack", SlackReceiver, 1.0),
        ("webhook", WebhookReceiver, 0.0),
        ("alertmanager", AlertmanagerReceiver, 0.0),
    ],
)
def test_build_receiver(kind: str, cls: type, interval: float) -> None:
    config = ReceiverConfig(
        name="r",
        type=kind,  # type: ignore[arg-type]
        url="https://example.com/x",  # type: ignore[arg-type]
        secret="k" if kind == "webhook" else None,  # type: ignore[arg-type]
        send_resolved=False,
    )
    with httpx.Client() as client:
        receiver = build_receiver(config, client=client)
    assert isinstance(receiver, cls)
    assert (receiver.name, receiver.type, receiver.send_resolved) == ("r", kind, False)
    assert receiver.min_interval_seconds == interval
    assert repr(receiver) == f"{cls.__name__}(name='r')"


def test_mock_transport_is_a_seam(notification) -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, text="ok")

    config = ReceiverConfig(name="r", type="slack", url="https://hooks.slack.com/services/a")  # type: ignore[arg-type]
    with httpx.Client(transport=httpx.MockTransport(handler)) as client:
        note: Notification = notification()
        assert build_receiver(config, client=client).attempt(note).outcome == "sent"
    assert seen[0].url == "https://hooks.slack.com/services/a"
    assert seen[0].headers["user-agent"].startswith("gpuwatch/")


def test_public_surface() -> None:
    assert receivers.__all__ == ["Receiver", "build_receiver"]
    assert all(hasattr(receivers, name) for name in receivers.__all__)


def test_texts() -> None:
    assert format_bytes(61 * 2**30) == "61.0 GiB"
    assert format_bytes(512) == "512 B"
    assert format_bytes(3 * 2**20) == "3.0 MiB"
    assert format_rate(20 * 2**20) == "+1.2 GiB/min"
    assert format_rate(-(2**20) / 60) == "-1.0 MiB/min"
    unknown = Culprit(pid=7, user=None, command=None, memory_bytes=None)
    assert culprit_line(unknown) == "unknown user: unknown command (pid 7)"
    assert culprit_line(Culprit(pid=7, user="u", command="c " * 100, memory_bytes=0)).endswith(
        "… (0 B, pid 7)"
    )


def test_a_receiver_s_answer_cannot_drive_the_terminal_it_is_shown_on() -> None:
    """``alerts test-receiver`` prints a 2xx answer's text: an ESC in it set the window
    title and cleared the screen. The reason is one line, its controls escaped."""
    reply = Reply(
        200, httpx.Headers(), b"\x1b]0;pwned\x07thanks\x1b[2J\r\nsecond line \xe2\x80\xae"
    )
    attempt = classify(reply, label="webhook 'x'", redact=Redactor([]), now=0.0)
    assert attempt.outcome == "sent"
    assert "\x1b" not in attempt.detail and "\u202e" not in attempt.detail
    assert "\\x1b]0;pwned\\x07thanks\\x1b[2J second line \\u202e" in attempt.detail
