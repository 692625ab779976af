"""The alert API over real HTTP: who may read and change it, what receivers' states it
reports, and that no receiver credential ever comes out of it.

The receiver is a real webhook whose URL path and HMAC key are distinctive strings; the
local endpoint it posts to echoes the request's path back in every answer, as some
proxies do, so a detail that quotes the answer would leak the path unless redacted.
Deliveries fail (500, then 404) and succeed (200); the test then reads every surface:
the API's answers, the OpenAPI schema, /metrics, the log records at DEBUG, and the
command line's output.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from fastapi import FastAPI

from gpuwatch.settings import ServerSettings
from server.factories import T0, body, gpu, process, snapshot
from server.harness import Live

READ = "read-token-for-api-tests"
ADMIN = "admin-token-for-api-tests"
SECRET_PATH = "SECRETPATH123"
SECRET_KEY = "SECRETKEY456"
SILENCE = {"matchers": [{"name": "hostname", "value": "host-1"}], "duration_seconds": 600}


@dataclass
class Echo:
    """A webhook endpoint answering ``status`` with a body that quotes the request."""

    url: str
    status: int = 200
    paths: list[str] = field(default_factory=list)
    # Also quote the request in a Location header (a redirect to the "right" URL).
    location: bool = False


@pytest.fixture
def echo() -> Iterator[Echo]:
    box: list[Echo] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            target = box[0]
            target.paths.append(self.path)
            answer = f"no hook at {self.path} (signed {self.headers.get('X-Gpuwatch-Signature')})"
            raw = answer.encode()
            self.send_response(target.status)
            self.send_header("Content-Length", str(len(raw)))
            if target.location:
                self.send_header("Location", f"https://hooks.example.com{self.path}")
            self.end_headers()
            self.wfile.write(raw)

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    box.append(Echo(f"http://127.0.0.1:{server.server_address[1]}"))
    thread = threading.Thread(target=server.serve_forever, args=(0.01,), daemon=True)
    thread.start()
    try:
        yield box[0]
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def closed_port() -> int:
    """A local port nothing listens on (connection refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def settings(tmp_path: Path, database_url: str, echo: Echo, closed_port: int) -> ServerSettings:
    return ServerSettings.model_validate(
        {
            "data_dir": tmp_path,
            "database_url": database_url,
            "scheduler": False,
            "agent_push_interval_seconds": 15,
            "read_token": READ,
            "admin_token": ADMIN,
            "receivers": [
                {
                    "name": "leaky",
                    "type": "webhook",
                    "url": f"{echo.url}/hook/{SECRET_PATH}?key={SECRET_KEY}",
                    "secret": SECRET_KEY,
                },
                {
                    "name": "unreachable",
                    "type": "webhook",
                    "url": f"http://127.0.0.1:{closed_port}/hook/{SECRET_PATH}",
                    "secret": SECRET_KEY,
                    "timeout_seconds": 2,
                },
            ],
            "alerts": {"group_wait": "0s", "routes": [{"receiver": "leaky"}]},
        }
    )


def auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def lose_gpu(live: Live, host: str, at: float) -> None:
    token = live.token(host)
    lost = gpu(1, lost=True, memory_used_bytes=None, memory_free_bytes=None)
    snap = snapshot(0, [gpu(0, [process(7)]), lost], hostname=host, at=at)
    assert live.push(token, body(snap)).status_code == 200


def run_engine(app: FastAPI, settings: ServerSettings, live: Live, at: float) -> None:
    live.clock.now = max(live.clock.now, at)
    app.state.gpuwatch.alerts.run(database=live.database, settings=settings, now=at)


def receivers(live: Live) -> dict[str, dict[str, object]]:
    response = live.client.get("/api/v1/receivers", headers=auth(READ))
    assert response.status_code == 200, response.text
    return {r["name"]: r for r in response.json()}


def test_changes_need_the_admin_token_and_reads_the_read_token(live: Live) -> None:
    post = live.client.post
    without = post("/api/v1/silences", json={**SILENCE, "created_by": "a"})
    with_read = post("/api/v1/silences", json={**SILENCE, "created_by": "a"}, headers=auth(READ))
    with_admin = post("/api/v1/silences", json={**SILENCE, "created_by": "a"}, headers=auth(ADMIN))

    assert without.status_code == 401
    assert without.headers["WWW-Authenticate"] == "Bearer"
    assert (with_read.status_code, with_read.json()["detail"]) == (403, "wrong admin token")
    assert with_admin.status_code == 201, with_admin.text
    sid = with_admin.json()["id"]
    for method, path in [
        ("DELETE", f"/api/v1/silences/{sid}"),
        ("POST", "/api/v1/receivers/leaky/test"),
    ]:
        assert live.client.request(method, path).status_code == 401
        assert live.client.request(method, path, headers=auth(READ)).status_code == 403
    for path in ("/api/v1/alerts", "/api/v1/silences", "/api/v1/receivers"):
        assert live.client.get(path).status_code == 401
        assert live.client.get(path, headers=auth("wrong")).status_code == 403
        assert live.client.get(path, headers=auth(READ)).status_code == 200
    # Nothing the refused requests asked for happened.
    (only,) = live.client.get("/api/v1/silences", headers=auth(READ)).json()
    assert (only["id"], only["state"]) == (sid, "active")
    assert receivers(live)["leaky"]["status"] == "unknown"


def test_bad_silences_and_unknown_ids_are_answered_not_crashed(live: Live) -> None:
    def create(**changes: object) -> int:
        silence = {**SILENCE, "created_by": "a", **changes}
        response = live.client.post("/api/v1/silences", json=silence, headers=auth(ADMIN))
        return response.status_code

    assert create(matchers=[{"name": "host", "value": "x"}]) == 422
    assert create(matchers=[{"name": "rule", "value": "(", "regex": True}]) == 422
    assert create(matchers=[]) == 422
    assert create(ends_at=T0 + 60) == 422  # both an end and a duration
    assert create(duration_seconds=None, ends_at=T0 - 60) == 422  # ends before it starts
    assert create(created_by="") == 422
    missing = live.client.delete("/api/v1/silences/4242", headers=auth(ADMIN))
    assert (missing.status_code, missing.json()["detail"]) == (404, "no silence 4242")
    unknown = live.client.post("/api/v1/receivers/nope/test", headers=auth(ADMIN))
    assert unknown.status_code == 404


def test_a_receiver_that_refuses_deliveries_shows_broken_and_recovers_to_ok(
    live: Live, app: FastAPI, settings: ServerSettings, echo: Echo
) -> None:
    echo.status = 404
    lose_gpu(live, "host-1", at=T0)
    run_engine(app, settings, live, T0)

    leaky = receivers(live)["leaky"]
    assert leaky["status"] == "broken" and leaky["pending"] == 0
    assert str(leaky["last_error"]).startswith("webhook receiver 'leaky': HTTP 404")
    assert receivers(live)["unreachable"]["status"] == "unknown"  # routed nothing

    echo.status = 200
    lose_gpu(live, "host-2", at=T0 + 60)
    run_engine(app, settings, live, T0 + 60)
    leaky = receivers(live)["leaky"]
    assert (leaky["status"], leaky["last_error"], leaky["last_sent_at"]) == ("ok", None, T0 + 60)


def gw(live: Live, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gpuwatch", "alerts", *args, "--server", live.url],
        env={
            **os.environ,
            "GPUWATCH_CONFIG": "/dev/null",
            "GPUWATCH_SERVER_READ_TOKEN": READ,
            "GPUWATCH_SERVER_ADMIN_TOKEN": ADMIN,
        },
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_receiver_credentials_never_leak(
    live: Live,
    app: FastAPI,
    settings: ServerSettings,
    echo: Echo,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    seen: list[str] = []

    def get(path: str) -> str:
        response = live.client.get(path, headers=auth(READ))
        assert response.status_code == 200, response.text
        seen.append(response.text)
        return response.text

    def test_receiver(name: str, outcome: str) -> None:
        response = live.client.post(f"/api/v1/receivers/{name}/test", headers=auth(ADMIN))
        assert (response.status_code, response.json()["outcome"]) == (200, outcome)
        seen.append(response.text)

    # Fails for now (500: retried), then for good (404: broken), then is delivered.
    echo.status = 500
    lose_gpu(live, "host-1", at=T0)
    run_engine(app, settings, live, T0)
    test_receiver("leaky", "retry")
    get("/api/v1/receivers")
    echo.status = 404
    run_engine(app, settings, live, T0 + 120)
    test_receiver("leaky", "broken")
    get("/api/v1/receivers")
    echo.status = 200
    lose_gpu(live, "host-2", at=T0 + 180)
    run_engine(app, settings, live, T0 + 180)
    test_receiver("leaky", "sent")
    test_receiver("unreachable", "retry")
    for path in ("/api/v1/alerts", "/api/v1/alerts?state=resolved", "/api/v1/receivers"):
        get(path)
    metrics = get("/metrics")
    seen.append(live.client.get("/openapi.json").text)
    for args in (["test-receiver", "leaky"], ["test-receiver", "unreachable"], ["list"]):
        result = gw(live, *args)
        seen += [result.stdout, result.stderr]
    echo.status = 404
    refused = gw(live, "test-receiver", "leaky")
    seen += [refused.stdout, refused.stderr]

    # The deliveries really happened, at the secret path, and failed as planned.
    assert len(echo.paths) >= 7 and all(SECRET_PATH in p for p in echo.paths)
    assert refused.returncode == 9 and "HTTP 404 no hook at <redacted>" in refused.stderr
    # The last test was refused for good: the receiver shows broken, its reason redacted.
    states = {r["name"]: (r["status"], r["last_error"]) for r in receivers(live).values()}
    seen.append(str(states))
    assert states["leaky"][0] == "broken" and "HTTP 404" in states["leaky"][1]
    # One delivery and one test refused for good before the metrics were read.
    assert 'gpuwatch_server_notifications_total{outcome="broken",receiver="leaky"} 2.0' in metrics
    records = [r.getMessage() for r in caplog.records] + [caplog.text]
    assert any("<redacted>" in text for text in records), "the failures were logged, redacted"
    for text in seen + records:
        assert SECRET_PATH not in text and SECRET_KEY not in text, text


def test_a_redirect_quoting_the_receiver_url_is_not_logged_at_debug(
    live: Live, echo: Echo, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    echo.status, echo.location = 301, True

    response = live.client.post("/api/v1/receivers/leaky/test", headers=auth(ADMIN))

    assert response.json()["outcome"] == "broken"
    assert "redirects are not followed" in response.json()["detail"]
    assert SECRET_PATH not in response.text and SECRET_KEY not in response.text
    for record in caplog.records:
        message = record.getMessage()
        assert SECRET_PATH not in message and SECRET_KEY not in message, message


def test_expiring_a_silence_that_has_not_started_ends_it(live: Live) -> None:
    future = {**SILENCE, "starts_at": T0 + 3600, "created_by": "a"}
    created = live.client.post("/api/v1/silences", json=future, headers=auth(ADMIN)).json()
    assert created["state"] == "pending"

    expired = live.client.delete(f"/api/v1/silences/{created['id']}", headers=auth(ADMIN))

    assert expired.json()["state"] == "expired"
    assert live.client.get("/api/v1/silences", headers=auth(READ)).json() == []
