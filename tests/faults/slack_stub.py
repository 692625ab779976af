"""A local stand-in for a Slack incoming webhook whose answers a test scripts.

Each POST is recorded with the injected clock's time and answered by ``answer(at,
body)``: Slack's own shapes (``200 ok``, ``429`` with ``Retry-After`` and its JSON
body, ``500``). ``on_post`` runs on receipt, before the answer is written: a test
can kill the sender right there, between "Slack has the message" and "the sender
heard so".
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

Answer = tuple[int, dict[str, str], bytes]

OK: Answer = (200, {}, b"ok")
SERVER_ERROR: Answer = (500, {}, b"internal_error")


def rate_limited(retry_after: int) -> Answer:
    body = json.dumps({"ok": False, "error": "rate_limited", "retry_after": retry_after})
    return 429, {"Retry-After": str(retry_after)}, body.encode()


@dataclass
class Post:
    at: float
    status: int
    retry_after: float | None
    raw: bytes

    @property
    def text(self) -> str:
        return str(json.loads(self.raw)["text"])


@dataclass
class Slack:
    url: str
    clock: Callable[[], float]
    answer: Callable[[float, bytes], Answer] = lambda _at, _body: OK
    on_post: Callable[[], None] | None = None
    posts: list[Post] = field(default_factory=list)

    def delivered(self) -> list[Post]:
        return [p for p in self.posts if p.status == 200]


@contextmanager
def slack(clock: Callable[[], float]) -> Iterator[Slack]:
    box: list[Slack] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            stub = box[0]
            raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            at = stub.clock()
            status, headers, reply = stub.answer(at, raw)
            retry = headers.get("Retry-After")
            stub.posts.append(Post(at, status, None if retry is None else float(retry), raw))
            if stub.on_post is not None:
                stub.on_post()
            self.send_response(status)
            for name, value in headers.items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    port = server.server_address[1]
    box.append(Slack(f"http://127.0.0.1:{port}/services/T0000/B0000/xoxbsecretpath", clock))
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield box[0]
    finally:
        server.shutdown()
        server.server_close()
