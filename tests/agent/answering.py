"""A local HTTP server that answers each POST as the test says and keeps every request.

Real HTTP over loopback, so the agent's own client (``gpuwatch.agent.http_post``) is
what talks to it: the status, headers and body the agent reads are the ones a server
sent.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass(frozen=True)
class Received:
    path: str
    headers: dict[str, str]  # names in lower case
    body: bytes


# The answer to one request: status and JSON body, or status, body and Content-Type.
Answer = Callable[[Received], tuple[int, bytes] | tuple[int, bytes, str]]


@dataclass
class Answering:
    url: str
    received: list[Received] = field(default_factory=list)


@contextmanager
def answering(answer: Answer) -> Iterator[Answering]:
    """Serve on a free loopback port until the block ends."""
    box: list[Answering] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            got = Received(self.path, {k.lower(): v for k, v in self.headers.items()}, body)
            box[0].received.append(got)
            status, reply, *content_type = answer(got)
            self.send_response(status)
            self.send_header(
                "Content-Type", content_type[0] if content_type else "application/json"
            )
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, format: str, *args: object) -> None:
            pass  # keep test output quiet

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    box.append(Answering(f"http://127.0.0.1:{server.server_address[1]}"))
    thread = threading.Thread(target=server.serve_forever, args=(0.01,), daemon=True)
    thread.start()
    try:
        yield box[0]
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
