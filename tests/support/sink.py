"""A local HTTP server that takes notifications and remembers when each arrived.

Like Alertmanager's acceptance-test webhook: it records each request's raw body and
headers with the *injected* clock's time, so a timeline test can say "exactly one
POST at t = 30 s" without sleeping. It answers 200 unless ``status`` says otherwise.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass
class Delivery:
    at: float
    headers: dict[str, str]
    raw: bytes

    @property
    def body(self) -> Any:
        return json.loads(self.raw)


@dataclass
class Sink:
    url: str
    clock: Callable[[], float]
    deliveries: list[Delivery] = field(default_factory=list)
    status: int = 200

    def at(self) -> list[float]:
        return [d.at for d in self.deliveries]


@contextmanager
def sink(clock: Callable[[], float]) -> Iterator[Sink]:
    box: list[Sink] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            target = box[0]
            target.deliveries.append(Delivery(target.clock(), dict(self.headers), raw))
            self.send_response(target.status)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"ok")

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    box.append(Sink(f"http://127.0.0.1:{server.server_address[1]}/hook", clock))
    thread = threading.Thread(target=server.serve_forever, args=(0.01,), daemon=True)
    thread.start()
    try:
        yield box[0]
    finally:
        server.shutdown()
        server.server_close()
