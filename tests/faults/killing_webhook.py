"""A webhook endpoint that SIGKILLs the server sending to it, on the first notification.

The receiver side of "the server killed between sending a notification and recording
it". Every POST is kept (raw body and headers). On the first one the sender, a
``gpuwatch server`` process, is killed before the endpoint answers, or after: then the
sender is first stopped (SIGSTOP, waited on until the kernel says it is stopped), the
200 is written to the socket, and only then is the sender killed, so the answer is on
the wire yet the sender never reads it, let alone records it. Later POSTs get a 200.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Literal

When = Literal["before_answering", "after_answering"]


@dataclass
class Post:
    raw: bytes
    headers: dict[str, str]
    at: float = field(default_factory=time.time)  # epoch seconds it arrived

    def body(self) -> Any:
        return json.loads(self.raw)


@dataclass
class KillingWebhook:
    url: str
    when: When
    victim: int | None = None  # the server's pid, set once it is started
    posts: list[Post] = field(default_factory=list)
    killed: int | None = None  # the pid it killed
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def count(self) -> int:
        with self._lock:
            return len(self.posts)

    def _record(self, post: Post) -> bool:
        """Keep the post; True when this one is the first, the one to kill on."""
        with self._lock:
            self.posts.append(post)
            return len(self.posts) == 1


def _wait_stopped(pid: int) -> None:
    """Until ``/proc/<pid>/stat`` says T (stopped): SIGSTOP is asynchronous."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        stat = Path(f"/proc/{pid}/stat").read_text()
        if stat[stat.rindex(")") + 2] in "Tt":
            return
        time.sleep(0.001)
    raise AssertionError(f"pid {pid} did not stop")


@contextmanager
def killing_webhook(when: When) -> Iterator[KillingWebhook]:
    box: list[KillingWebhook] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            hook = box[0]
            raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            first = hook._record(Post(raw, dict(self.headers)))
            if first and hook.victim is not None:
                if hook.when == "before_answering":
                    os.kill(hook.victim, signal.SIGKILL)
                    hook.killed = hook.victim
                    return  # no answer: the connection just closes
                os.kill(hook.victim, signal.SIGSTOP)
                _wait_stopped(hook.victim)
                self._ok()
                os.kill(hook.victim, signal.SIGKILL)
                hook.killed = hook.victim
                return
            self._ok()

        def _ok(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"ok")
            self.wfile.flush()

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    box.append(KillingWebhook(f"http://127.0.0.1:{server.server_address[1]}/hook", when))
    thread = threading.Thread(target=server.serve_forever, args=(0.01,), daemon=True)
    thread.start()
    try:
        yield box[0]
    finally:
        server.shutdown()
        server.server_close()
