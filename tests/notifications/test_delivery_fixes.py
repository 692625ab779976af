"""Receiver settings and credentials, as the delivery audit found them wanting: query
values in receiver URLs, durations, and the CLI's wait for a slow receiver."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
from pydantic import ValidationError

from gpuwatch.server.alerts import dispatch, rules
from gpuwatch.server.alerts.config import AlertSettings, Rules
from gpuwatch.server.alerts.engine import sample_notification
from gpuwatch.server.client import AlertsClient
from gpuwatch.server.notifications.config import MAX_TIMEOUT_SECONDS, ReceiverConfig
from gpuwatch.server.notifications.model import Notification, NotifiedAlert
from gpuwatch.server.notifications.receivers import build_receiver
from gpuwatch.server.notifications.receivers.base import Redactor
from gpuwatch.server.notifications.receivers.webhook import payload

DOC = Path(__file__).resolve().parents[2] / "docs" / "alerts-webhook.md"


@pytest.mark.parametrize("kind", ["webhook", "alertmanager", "slack"])
def test_a_query_secret_echoed_by_the_receiver_is_redacted(kind: str) -> None:
    echoed = "bad token QUERYSECRET, also QUERY/SECRET2 and 'QUERY%2FSECRET2' refused"

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(403, json={"error": echoed})

    config = ReceiverConfig.model_validate(
        {
            "name": "q",
            "type": kind,
            "url": "https://hook.example.com/x?token=QUERYSECRET&sig=QUERY%2FSECRET2&v=1",
            **({"secret": "k"} if kind == "webhook" else {}),
        }
    )
    receiver = build_receiver(config, client=httpx.Client(transport=httpx.MockTransport(handler)))
    attempt = receiver.attempt(sample_notification("q", 1_800_000_000.0))
    assert attempt.outcome == "broken"
    assert "QUERYSECRET" not in attempt.detail
    assert "SECRET2" not in attempt.detail, attempt.detail
    assert "HTTP 403" in attempt.detail  # short values ("1") are left alone


def test_redactor_takes_each_query_value_raw_and_decoded() -> None:
    config = ReceiverConfig.model_validate(
        {"name": "q", "type": "slack", "url": "https://h.example/p?a=ab%20cd+ef&b=QUERYSECRET"}
    )
    redact = Redactor.for_config(config)
    assert redact("x QUERYSECRET ab cd ef ab%20cd+ef y") == "x <redacted> <redacted> <redacted> y"


def test_receiver_timeout_is_a_duration() -> None:
    def make(timeout: object) -> ReceiverConfig:
        return ReceiverConfig.model_validate(
            {"name": "a", "type": "slack", "url": "https://h.example/x", "timeout_seconds": timeout}
        )

    assert make("10s").timeout_seconds == 10.0
    assert make("1m").timeout_seconds == 60.0
    assert make(2.5).timeout_seconds == 2.5
    for bad in ("61s", "0s", "soon"):
        with pytest.raises(ValidationError):
            make(bad)


@pytest.mark.parametrize("url", ["gpuwatch.example.internal", "ftp://x.example/", "https://"])
def test_external_url_must_be_absolute_http(url: str) -> None:
    with pytest.raises(ValidationError, match="external_url must be an absolute"):
        AlertSettings.model_validate({"external_url": url})
    assert AlertSettings.model_validate({"external_url": "https://gw.example/"}).external_url


def test_test_receiver_waits_longer_than_any_receiver_may_take() -> None:
    seen: list[dict[str, float]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.extensions["timeout"])
        if request.url.path.endswith("/test"):
            body = {"receiver": "a", "outcome": "sent", "detail": "ok", "status_code": 200}
            return httpx.Response(200, json=body)
        return httpx.Response(200, json=[])

    with AlertsClient("http://gw.example", transport=httpx.MockTransport(handler)) as client:
        client.test_receiver("a")
        client.alerts()
    assert seen[0]["read"] > MAX_TIMEOUT_SECONDS
    assert seen[1]["read"] == 10.0  # other calls keep their timeout


def test_the_docs_example_is_what_the_code_builds() -> None:
    """The example's rule exists, and its group_key, group_labels and fingerprint are
    what the default grouping and the fingerprint make of its labels."""
    text = DOC.read_text()
    example = json.loads(re.findall(r"```json\n(.*?)```", text, re.DOTALL)[0])
    documented = example["alerts"][0]
    assert documented["rule"] in Rules.model_fields
    labels = documented["labels"]
    key, values = dispatch.group_of(labels, AlertSettings().group_by)
    assert example["group_key"] == key
    assert example["group_labels"] == values
    assert documented["fingerprint"] == rules.fingerprint(labels)
    notified = NotifiedAlert(
        **{k: v for k, v in documented.items() if k != "culprits"},
        culprits=[],
    )
    built = payload(
        Notification(
            example["receiver"], key, values, "firing", [notified], example["external_url"]
        )
    )
    assert {k: v for k, v in built.items() if k != "alerts"} == {
        k: v for k, v in example.items() if k != "alerts"
    }
    # The dedupe key the doc gives includes the episode.
    assert "(`group_key`, `fingerprint`,\n`status`, `starts_at`)" in text
