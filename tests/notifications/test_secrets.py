"""Receiver URLs and secrets never show: not in repr, attempt details, logs or config errors."""

from __future__ import annotations

import logging

import httpx
import pytest
from pydantic import BaseModel, ValidationError

from gpuwatch.server.notifications.config import ReceiverConfig, ReceiverList
from gpuwatch.server.notifications.receivers import build_receiver

TOKEN = "xoxbTOKEN5ecretPathPart"
SECRET = "hmacS3cretValue"
PASSWORD = "amPassw0rd"


def _config(kind: str, url: str) -> ReceiverConfig:
    if kind == "alertmanager":
        url = url.replace("http://", f"http://admin:{PASSWORD}@")
    return ReceiverConfig(
        name="team-a",
        type=kind,  # type: ignore[arg-type]
        url=url,  # type: ignore[arg-type]
        secret=SECRET if kind == "webhook" else None,  # type: ignore[arg-type]
        timeout_seconds=0.3,
    )


def _leaks(text: str) -> list[str]:
    return [s for s in (TOKEN, SECRET, PASSWORD) if s in text]


@pytest.mark.parametrize("kind", ["slack", "webhook", "alertmanager"])
def test_no_failure_shows_a_credential(
    kind, receiver_server, hanging_url, refused_url, client, notification, caplog
) -> None:
    caplog.set_level(logging.DEBUG)
    url = receiver_server.url(f"/services/T0/B0/{TOKEN}")
    config = _config(kind, url)
    # Answers that echo the request's URL, path and credentials back, as some proxies do.
    known = {"slack": [TOKEN], "webhook": [TOKEN, SECRET], "alertmanager": [TOKEN, PASSWORD]}
    echo = f"no hook at {config.url.get_secret_value()} /services/T0/B0/{TOKEN} " + " ".join(
        known[kind]
    )
    for status in (400, 403, 404, 410, 429, 500, 503, 301):
        receiver_server.answer(status, echo, Retry_After="1")
    receiver_server.answer(200, echo)  # sent for webhook and alertmanager, broken for slack
    receiver_server.answer(404, f'{{"ok":false,"error":"{TOKEN}"}}')
    receiver = build_receiver(config, client=client)
    attempts = [receiver.attempt(notification()) for _ in range(10)]
    attempts.append(
        build_receiver(_config(kind, hanging_url), client=client).attempt(notification())
    )
    attempts.append(
        build_receiver(_config(kind, refused_url), client=client).attempt(notification())
    )

    assert {a.outcome for a in attempts} >= {"retry", "broken"}
    for attempt in attempts:
        assert attempt.detail.startswith(f"{kind} receiver 'team-a': ")
        assert _leaks(attempt.detail) == [], attempt.detail
        assert _leaks(repr(attempt)) == []
    assert caplog.records, "httpx logs each request; the test must see those lines"
    for record in caplog.records:
        assert _leaks(record.getMessage()) == [], record.getMessage()
    assert _leaks(caplog.text) == []
    assert any("<redacted>" in r.getMessage() for r in caplog.records if r.name == "httpx")
    assert _leaks(repr(receiver)) == []


@pytest.mark.parametrize("kind", ["slack", "webhook", "alertmanager"])
def test_the_config_does_not_show_its_credentials(kind) -> None:
    config = _config(kind, f"https://hooks.example.com/services/T0/B0/{TOKEN}")
    for text in (repr(config), str(config), config.model_dump_json(), str(config.public())):
        assert _leaks(text) == [], text
    assert config.label() == f"{kind} receiver 'team-a'"


@pytest.mark.parametrize(
    "values",
    [
        {"type": "slack", "url": f"ftp://hooks.example.com/{TOKEN}"},
        {"type": "slack", "url": f"https:///{TOKEN}"},
        {"type": "slack", "url": f"https://hooks.example.com/{TOKEN}", "secret": SECRET},
        {"type": "slack", "url": f"https://hooks.example.com/{TOKEN}", "scret": SECRET},
        {"type": "slack", "url": f"https://hooks.example.com/{TOKEN}", "timeout_seconds": 0},
        {"type": "webhook", "url": f"https://x:{PASSWORD}@hooks.example.com/{TOKEN}"},
        {"type": "teams", "url": f"https://hooks.example.com/{TOKEN}", "secret": SECRET},
    ],
)
def test_config_errors_do_not_echo_credentials(values) -> None:
    with pytest.raises(ValidationError) as caught:
        ReceiverConfig(name="team-a", **values)
    assert _leaks(str(caught.value)) == [], str(caught.value)
    assert _leaks(repr(caught.value.errors(include_input=False))) == []


def test_errors_inside_the_settings_list_do_not_echo_credentials() -> None:
    class Settings(BaseModel):
        receivers: ReceiverList = []

    with pytest.raises(ValidationError) as caught:
        Settings(receivers=[{"name": "a", "type": "slack", "url": f"gopher://h/{TOKEN}"}])  # type: ignore[list-item]
    assert _leaks(str(caught.value)) == []


def test_transport_errors_do_not_quote_the_url(client, notification) -> None:
    def explode(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError(f"cannot connect to {request.url}", request=request)

    with httpx.Client(transport=httpx.MockTransport(explode)) as mock:
        receiver = build_receiver(
            _config("slack", f"https://hooks.example.com/services/T0/B0/{TOKEN}"), client=mock
        )
        attempt = receiver.attempt(notification())
    assert attempt.outcome == "retry"
    assert attempt.detail == "slack receiver 'team-a': connection failed (ConnectError)"
