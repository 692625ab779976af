"""The demo's alert receiver: a tiny signed-webhook endpoint in the demo process.

The demo's server sends every notification to it as a ``webhook`` receiver
(docs/alerts-webhook.md). It checks each body's ``X-Gpuwatch-Signature`` against the
run's random secret, as a real endpoint must, answers 401 to a body that does not
match, and keeps what arrived for the live summary.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

# A notification is one group's alerts; far below this.
MAX_BODY_BYTES = 1 << 20


@dataclass(frozen=True)
class Notification:
    """One verified notification: when it arrived (epoch s) and what it said."""

    received_at: float
    status: str  # firing | resolved
    alerts: tuple[tuple[str, str, str], ...]  # (rule, status, summary)

    def to_json(self) -> dict[str, Any]:
        return {
            "received_at": self.received_at,
            "status": self.status,
            "alerts": [{"rule": r, "status": s, "summary": m} for r, s, m in self.alerts],
        }


def signature_matches(raw: bytes, header: str | None, secret: str) -> bool:
    """The check docs/alerts-webhook.md asks of every endpoint, in constant time."""
    expected = "sha256=" + hmac.new(secret.encode(), raw, hashlib.sha256).hexdigest()
    return header is not None and hmac.compare_digest(expected.encode(), header.encode())


def _parse(raw: bytes, received_at: float) -> Notification | None:
    try:
        body = json.loads(raw)
        alerts = tuple(
            (str(a["rule"]), str(a["status"]), str(a["summary"])) for a in body["alerts"]
        )
        return Notification(received_at, str(body["status"]), alerts)
    except (ValueError, KeyError, TypeError):
        return None


class WebhookSink:
    """Bound on ``127.0.0.1`` at once (so its URL is known); serves after :meth:`start`."""

    def __init__(self, secret: str) -> None:
        self.secret = secret
        self._lock = threading.Lock()
        self._received: list[Notification] = []
        self.rejected = 0
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                if not 0 < length <= MAX_BODY_BYTES:
                    self._answer(413)
                    return
                raw = self.rfile.read(length)
                self._answer(sink.receive(raw, self.headers.get("X-Gpuwatch-Signature")))

            def _answer(self, code: int) -> None:
                self.send_response(code)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: object) -> None:
                pass  # the live summary shows what arrived

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}/hook"
        self._thread: threading.Thread | None = None

    def receive(self, raw: bytes, signature: str | None) -> int:
        """Record a notification; returns the HTTP status to answer."""
        if not signature_matches(raw, signature, self.secret):
            with self._lock:
                self.rejected += 1
            return 401
        notification = _parse(raw, time.time())
        if notification is None:
            return 400
        with self._lock:
            self._received.append(notification)
        return 200

    def received(self) -> list[Notification]:
        with self._lock:
            return list(self._received)

    def start(self) -> None:
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="gpuwatch-demo-sink", daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        if self._thread is not None:
            self._server.shutdown()
        self._server.server_close()
