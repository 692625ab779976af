"""The generic webhook: the body docs/alerts-webhook.md specifies, signed over the raw bytes.

The signature is checked by a verifier written here from the spec, independently of
``webhook.sign``, on the bytes the local server received; the snippet in the doc is
executed too, so the doc cannot drift from what is sent.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
from datetime import UTC, datetime
from email.utils import format_datetime
from pathlib import Path

import httpx
import pytest
from support.clock import FakeClock

from gpuwatch.server.notifications.config import ReceiverConfig
from gpuwatch.server.notifications.receivers import Receiver, build_receiver
from gpuwatch.server.notifications.receivers.webhook import payload, render, sign

SECRET = "s3cr3t-shared-with-the-endpoint"
DOC = Path(__file__).resolve().parents[2] / "docs" / "alerts-webhook.md"


def independent_verify(raw_body: bytes, header: str, secret: str) -> bool:
    """The spec, read literally: ``sha256=<hex HMAC-SHA256 of the raw body with the secret>``."""
    scheme, _, digest = header.partition("=")
    mac = hmac.new(secret.encode("utf-8"), raw_body, hashlib.sha256)
    return scheme == "sha256" and hmac.compare_digest(mac.hexdigest(), digest)


def webhook(
    url: str, client: httpx.Client, *, clock: FakeClock | None = None, **extra: object
) -> Receiver:
    config = ReceiverConfig(name="ops-hook", type="webhook", url=url, secret=SECRET, **extra)  # type: ignore[arg-type]
    return build_receiver(config, client=client, clock=clock or FakeClock(0))


def test_the_signature_verifies_on_the_raw_bytes_received(
    receiver_server, client, notification
) -> None:
    receiver = webhook(receiver_server.url("/hooks/gpuwatch"), client)
    attempt = receiver.attempt(notification(external_url="https://gpuwatch.example.org"))
    assert (attempt.outcome, attempt.status_code) == ("sent", 200)

    got = receiver_server.received[0]
    assert got.path == "/hooks/gpuwatch"
    assert got.headers["content-type"] == "application/json"
    header = got.headers["x-gpuwatch-signature"]
    assert re.fullmatch(r"sha256=[0-9a-f]{64}", header)
    assert independent_verify(got.body, header, SECRET)
    assert not independent_verify(got.body, header, SECRET + "x")

    # Tampering with any byte, or re-encoding the same JSON, breaks the signature.
    tampered = got.body.replace(b'"firing"', b'"resolved"', 1)
    assert tampered != got.body and not independent_verify(tampered, header, SECRET)
    reencoded = json.dumps(json.loads(got.body), indent=2).encode()
    assert not independent_verify(reencoded, header, SECRET)


def test_sign_matches_the_spec() -> None:
    body = b'{"version":"1"}'
    expected = hmac.new(b"k", body, hashlib.sha256).hexdigest()
    assert sign(body, "k") == f"sha256={expected}"


def test_the_body_has_the_documented_fields(receiver_server, client, notification) -> None:
    note = notification(external_url="https://gpuwatch.example.org")
    webhook(receiver_server.url("/"), client).attempt(note)
    body = json.loads(receiver_server.received[0].body)

    assert body["version"] == "1"
    assert body["status"] == "firing"
    assert body["receiver"] == "team-a"
    assert body["group_key"] == note.group_key
    assert body["group_labels"] == {"hostname": "gpu-node-7"}
    assert body["external_url"] == "https://gpuwatch.example.org"
    (alert,) = body["alerts"]
    assert alert["rule"] == "gpu_filling_up"
    assert alert["status"] == "firing"
    assert alert["labels"]["severity"] == "warning"
    assert alert["summary"] == "GPU 3 on gpu-node-7 will be full in 18m"
    assert "predicted full in 18m" in alert["description"]
    assert alert["starts_at"] == 1_787_000_000.0
    assert alert["ends_at"] is None
    assert alert["fingerprint"] == "3f2a9c0d1b7e5a46"
    alice = alert["culprits"][0]
    assert {k: alice[k] for k in ("pid", "user", "command", "memory_bytes")} == {
        "pid": 48121,
        "user": "alice",
        "command": "python train.py --batch 512",
        "memory_bytes": 61 * 2**30,
    }
    assert alice["slurm_job_id"] == "918273"
    assert alice["slope_bytes_per_second"] == 20 * 2**20


def test_a_resolved_notification(receiver_server, client, notification, alert) -> None:
    webhook(receiver_server.url("/"), client).attempt(notification(alert("resolved")))
    body = json.loads(receiver_server.received[0].body)
    assert body["status"] == "resolved"
    assert body["alerts"][0]["status"] == "resolved"
    assert body["alerts"][0]["ends_at"] == 1_787_000_900.0


def test_render_is_deterministic_and_utf8(notification, alert) -> None:
    note = notification(alert(summary="GPU 3 füllt sich — 18 min"))
    assert render(note) == render(note)
    assert "füllt".encode() in render(note)


def test_the_docs_example_has_exactly_the_fields_sent(notification) -> None:
    example = json.loads(_code_blocks("json")[0])
    sent = payload(notification(external_url="https://x.example"))
    assert example.keys() == sent.keys()
    assert example["alerts"][0].keys() == sent["alerts"][0].keys()
    assert example["alerts"][0]["culprits"][0].keys() == sent["alerts"][0]["culprits"][0].keys()
    documented = set(re.findall(r"^\| `([a-z_]+)` \| [a-z]", DOC.read_text(), re.MULTILINE))
    assert documented == (
        set(sent) | set(sent["alerts"][0]) | set(sent["alerts"][0]["culprits"][0])
    ), "docs/alerts-webhook.md tables list every field, and only those"


def test_the_docs_verification_snippet_accepts_ours_and_rejects_tampering(
    receiver_server, client, notification
) -> None:
    namespace: dict[str, object] = {}
    exec(compile(_code_blocks("python")[0], str(DOC), "exec"), namespace)
    verify = namespace["verify"]
    webhook(receiver_server.url("/"), client).attempt(notification())
    got = receiver_server.received[0]
    header = got.headers["x-gpuwatch-signature"]
    assert verify(got.body, header, SECRET) is True  # type: ignore[operator]
    assert verify(got.body + b" ", header, SECRET) is False  # type: ignore[operator]
    assert verify(got.body, header, "wrong") is False  # type: ignore[operator]
    assert verify(got.body, "sha256=ünïcode", SECRET) is False  # type: ignore[operator]


@pytest.mark.parametrize(
    ("status", "outcome"),
    [
        (200, "sent"),
        (202, "sent"),
        (204, "sent"),
        (301, "broken"),
        (400, "broken"),
        (401, "broken"),
        (404, "broken"),
        (408, "retry"),
        (413, "broken"),
        (429, "retry"),
        (500, "retry"),
        (502, "retry"),
        (503, "retry"),
    ],
)
def test_outcome_by_status(receiver_server, client, notification, status, outcome) -> None:
    receiver_server.answer(status, "")
    attempt = webhook(receiver_server.url("/"), client).attempt(notification())
    assert (attempt.outcome, attempt.status_code) == (outcome, status)


def test_retry_after_as_an_http_date(receiver_server, client, notification) -> None:
    now = datetime(2026, 8, 22, 10, 0, 0, tzinfo=UTC)
    later = format_datetime(datetime(2026, 8, 22, 10, 2, 0, tzinfo=UTC), usegmt=True)
    receiver_server.answer(503, "maintenance", Retry_After=later)
    attempt = webhook(receiver_server.url("/"), client, clock=FakeClock(now.timestamp())).attempt(
        notification()
    )
    assert (attempt.outcome, attempt.retry_after) == ("retry", 120.0)


def test_timeout_and_refused_connection_are_retries(
    hanging_url, refused_url, client, notification
) -> None:
    assert webhook(hanging_url, client, timeout_seconds=0.3).attempt(notification()).outcome == (
        "retry"
    )
    assert webhook(refused_url, client).attempt(notification()).outcome == "retry"


def _code_blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", DOC.read_text(), re.MULTILINE | re.DOTALL)
