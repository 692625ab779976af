"""The Alertmanager receiver against a real ``prometheus-alertmanager`` (Debian package).

``./dev setup`` installs it; without it the test is skipped, except under ``CI=true``
where it must run.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import httpx
import pytest

from gpuwatch.server.notifications.config import ReceiverConfig
from gpuwatch.server.notifications.receivers import build_receiver
from gpuwatch.server.notifications.receivers.alertmanager import api_url, payload, rfc3339

BINARY = "prometheus-alertmanager"
CONFIG = """\
route:
  receiver: "null"
receivers:
  - name: "null"
"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def alertmanager(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    binary = shutil.which(BINARY)
    if binary is None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"{BINARY} is missing; under CI it must be installed (./dev setup)")
        pytest.skip(f"{BINARY} is not installed (./dev setup installs it)")
    root = tmp_path_factory.mktemp("alertmanager")
    (root / "alertmanager.yml").write_text(CONFIG)
    port = _free_port()
    log = (root / "alertmanager.log").open("wb")
    process = subprocess.Popen(
        [
            binary,
            f"--config.file={root / 'alertmanager.yml'}",
            f"--storage.path={root / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--cluster.listen-address=",  # no clustering, no gossip port
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(base, process, root / "alertmanager.log")
        yield base
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


def _wait_ready(base: str, process: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 30
    with httpx.Client(trust_env=False) as client:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                pytest.fail(f"{BINARY} exited {process.returncode}: {log.read_text()[-2000:]}")
            try:
                if client.get(f"{base}/-/ready", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
    pytest.fail(f"{BINARY} not ready after 30s: {log.read_text()[-2000:]}")


def _ours(client: httpx.Client, base: str) -> list[dict]:
    alerts = client.get(f"{base}/api/v2/alerts").json()
    return [a for a in alerts if a["labels"].get("hostname") == "gpu-node-7"]


def test_push_firing_then_resolved(alertmanager, client, notification, alert) -> None:
    receiver = build_receiver(
        ReceiverConfig(name="am", type="alertmanager", url=alertmanager + "/"), client=client
    )
    now = time.time()
    firing = alert(starts_at=now - 120)
    sent = receiver.attempt(notification(firing, external_url="https://gpuwatch.example.org/a"))
    assert (sent.outcome, sent.status_code) == ("sent", 200)

    (got,) = _ours(client, alertmanager)
    assert got["labels"] == {
        "alertname": "gpu_filling_up",
        "rule": "gpu_filling_up",
        "severity": "warning",
        "hostname": "gpu-node-7",
        "gpu": "3",
    }
    assert got["annotations"]["summary"] == "GPU 3 on gpu-node-7 will be full in 18m"
    assert "predicted full in 18m" in got["annotations"]["description"]
    culprits = got["annotations"]["culprits"]
    assert culprits.startswith("alice: python train.py --batch 512 (61.0 GiB, +1.2 GiB/min")
    assert "bob: jupyter-kernel" in culprits
    assert got["startsAt"] == rfc3339(firing.starts_at)
    assert got["generatorURL"] == "https://gpuwatch.example.org/a"
    assert got["status"]["state"] == "active"
    # No endsAt from us while firing: Alertmanager holds it for resolve_timeout (5m).
    assert got["endsAt"] > rfc3339(now + 200)

    # Resolved: the endsAt we send is the one Alertmanager keeps (one a moment ahead,
    # so the alert is still listed to look at), and once it passes the alert is gone.
    ends_at = time.time() + 1.5
    resolved = replace(firing, status="resolved", ends_at=ends_at)
    assert receiver.attempt(notification(resolved)).outcome == "sent"
    (got,) = _ours(client, alertmanager)
    assert got["endsAt"] == rfc3339(ends_at)
    deadline = time.monotonic() + 10
    while _ours(client, alertmanager) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _ours(client, alertmanager) == []


def test_a_resolved_alert_with_its_past_end_leaves_the_active_list(
    alertmanager, client, notification, alert
) -> None:
    receiver = build_receiver(
        ReceiverConfig(name="am", type="alertmanager", url=alertmanager), client=client
    )
    now = time.time()
    firing = alert(starts_at=now - 60, labels={**alert().labels, "gpu": "5"})
    assert receiver.attempt(notification(firing)).outcome == "sent"
    assert [a["labels"]["gpu"] for a in _ours(client, alertmanager)] == ["5"]
    resolved = replace(firing, status="resolved", ends_at=now - 1)
    assert receiver.attempt(notification(resolved)).outcome == "sent"
    assert _ours(client, alertmanager) == []


def test_alertmanager_refusing_the_alerts_is_broken(alertmanager, client, notification, alert):
    receiver = build_receiver(
        ReceiverConfig(name="am", type="alertmanager", url=alertmanager), client=client
    )
    # endsAt before startsAt (gpuwatch no longer sends one): Alertmanager answers 400.
    (item,) = payload(notification(alert(status="resolved", starts_at=time.time())))
    item["endsAt"] = rfc3339(time.time() - 3600)
    attempt = receiver.send(api_url(alertmanager), json.dumps([item]).encode(), {})
    assert (attempt.outcome, attempt.status_code) == ("broken", 400)
    assert attempt.detail.startswith("alertmanager receiver 'am': HTTP 400 ")


def test_an_end_before_the_start_is_sent_as_the_start(
    alertmanager, client, notification, alert
) -> None:
    """A clock stepped back between an alert's start and end makes endsAt < startsAt,
    which Alertmanager refuses (400): the end is sent as the start, and accepted."""
    receiver = build_receiver(
        ReceiverConfig(name="am", type="alertmanager", url=alertmanager), client=client
    )
    now = time.time()
    stepped = alert(
        status="resolved", starts_at=now, ends_at=now - 60, labels={**alert().labels, "gpu": "6"}
    )
    (item,) = payload(notification(stepped))
    assert item["endsAt"] == item["startsAt"] == rfc3339(now)
    assert receiver.attempt(notification(stepped)).outcome == "sent"


def test_server_errors_are_retried(receiver_server, client, notification) -> None:
    receiver_server.answer(503, "")
    receiver_server.answer(500, "")
    receiver_server.answer(200, "")
    receiver = build_receiver(
        ReceiverConfig(name="am", type="alertmanager", url=receiver_server.url("/prefix/")),
        client=client,
    )
    assert receiver.min_interval_seconds == 0.0
    assert [receiver.attempt(notification()).outcome for _ in range(3)] == [
        "retry",
        "retry",
        "sent",
    ]
    assert {r.path for r in receiver_server.received} == {"/prefix/api/v2/alerts"}
    body = json.loads(receiver_server.received[0].body)
    assert "endsAt" not in body[0] and "generatorURL" not in body[0]


def test_payload_mapping(notification, alert) -> None:
    odd = alert("resolved", labels={"rule": "r", "team-name": "ml", "9x": "y", "empty": ""})
    (item,) = payload(notification(odd, external_url="https://g.example"))
    assert item["labels"] == {
        "alertname": "gpu_filling_up",
        "rule": "r",
        "team_name": "ml",
        "_9x": "y",
    }
    assert item["endsAt"] == "2026-08-17T21:08:20.000Z"
    assert item["startsAt"] == "2026-08-17T20:53:20.000Z"
    assert item["generatorURL"] == "https://g.example"


def test_api_url_keeps_a_route_prefix() -> None:
    assert api_url("http://am:9093") == "http://am:9093/api/v2/alerts"
    assert api_url("http://am:9093/") == "http://am:9093/api/v2/alerts"
    assert api_url("https://u:p@am.example/alertmanager/") == (
        "https://u:p@am.example/alertmanager/api/v2/alerts"
    )
