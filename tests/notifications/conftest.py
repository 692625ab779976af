"""Fixtures for the receivers: real local HTTP servers that answer like Slack or a webhook.

``receiver_server`` records every request (path, headers, the raw body bytes) and answers
from a script of ``(status, headers, body)``; once the script runs out it answers
200 ``ok``. ``hanging_url`` accepts connections and never answers (timeouts);
``refused_url`` is a port nobody listens on.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from gpuwatch.server.notifications.model import Culprit, Notification, NotifiedAlert

Answer = tuple[int, dict[str, str], bytes]


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    body: bytes


@dataclass
class ReceiverServer:
    """A scripted HTTP server on 127.0.0.1; ``url(path)`` is where to point a receiver."""

    port: int
    script: list[Answer] = field(default_factory=list)
    received: list[Received] = field(default_factory=list)

    def url(self, path: str = "/") -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def answer(self, status: int, body: bytes | str = b"", **headers: str) -> None:
        raw = body.encode() if isinstance(body, str) else body
        self.script.append((status, {k.replace("_", "-"): v for k, v in headers.items()}, raw))


def _handler(server: ReceiverServer) -> type[BaseHTTPRequestHandler]:
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            with lock:
                server.received.append(
                    Received(self.path, {k.lower(): v for k, v in self.headers.items()}, body)
                )
                status, headers, answer = (
                    server.script.pop(0) if server.script else (200, {}, b"ok")
                )
            self.send_response(status)
            headers = {"Content-Type": "text/plain", **headers}
            for name, value in headers.items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, format: str, *args: object) -> None:
            pass  # keep test output clean

    return Handler


@pytest.fixture
def receiver_server() -> Iterator[ReceiverServer]:
    state = ReceiverServer(port=0)
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(state))
    httpd.daemon_threads = True
    state.port = httpd.server_address[1]
    thread = threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield state
    httpd.shutdown()
    httpd.server_close()
    thread.join(5)


@pytest.fixture
def hanging_url() -> Iterator[str]:
    """A listening socket that never accepts: the request goes out, no answer comes back."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}/services/T0/B0/HANGINGTOKEN123"
    sock.close()


@pytest.fixture
def refused_url() -> str:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now
    return f"http://127.0.0.1:{port}/services/T0/B0/REFUSEDTOKEN123"


@pytest.fixture
def client() -> Iterator[httpx.Client]:
    # trust_env=False: a proxy in the environment must not carry test traffic.
    with httpx.Client(trust_env=False) as c:
        yield c


def make_alert(status: str = "firing", **changes: object) -> NotifiedAlert:
    values: dict[str, object] = {
        "rule": "gpu_filling_up",
        "status": status,
        "labels": {
            "rule": "gpu_filling_up",
            "severity": "warning",
            "hostname": "gpu-node-7",
            "gpu": "3",
        },
        "summary": "GPU 3 on gpu-node-7 will be full in 18m",
        "description": "79.1 GiB of 80.0 GiB used, growing 1.2 GiB/min; predicted full in 18m.",
        "starts_at": 1_787_000_000.0,
        "ends_at": 1_787_000_900.0 if status == "resolved" else None,
        "fingerprint": "3f2a9c0d1b7e5a46",
        "culprits": [
            Culprit(
                pid=48121,
                user="alice",
                command="python train.py --batch 512",
                memory_bytes=61 * 2**30,
                container_id="4b8c1de2f3a4b5c6d7e8f9",
                pod_uid=None,
                slurm_job_id="918273",
                slope_bytes_per_second=20 * 2**20,
            ),
            Culprit(pid=5012, user="bob", command="jupyter-kernel", memory_bytes=12 * 2**30),
        ],
    }
    values.update(changes)
    return NotifiedAlert(**values)  # type: ignore[arg-type]


def make_notification(
    *alerts: NotifiedAlert, receiver: str = "team-a", external_url: str | None = None
) -> Notification:
    alerts = alerts or (make_alert(),)
    status = "firing" if any(a.status == "firing" for a in alerts) else "resolved"
    return Notification(
        receiver=receiver,
        group_key="team-a/{hostname=gpu-node-7}",
        group_labels={"hostname": "gpu-node-7"},
        status=status,
        alerts=list(alerts),
        external_url=external_url,
    )


@pytest.fixture
def notification() -> Callable[..., Notification]:
    return make_notification


@pytest.fixture
def alert() -> Callable[..., NotifiedAlert]:
    return make_alert
