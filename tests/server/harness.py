"""Test harness for the server: an injectable clock, tokens, a live uvicorn server."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import support.clock
import uvicorn
from fastapi import FastAPI

from gpuwatch.server.auth import service as auth_service
from gpuwatch.server.database import Database
from server.factories import T0


class FakeClock(support.clock.FakeClock):
    """The shared fake clock, starting at the server tests' fixed epoch."""

    def __init__(self, now: float = T0) -> None:
        super().__init__(now)


def make_token(database: Database, hostname: str, now: float = T0) -> str:
    with database.writer() as session, session.begin():
        return auth_service.create_token(session=session, hostname=hostname, now=now)


@dataclass
class Live:
    """A running server and a client for it."""

    url: str
    client: httpx.Client
    database: Database
    clock: FakeClock

    def token(self, hostname: str = "host-1") -> str:
        return make_token(self.database, hostname, self.clock())

    def push(self, token: str, body: dict[str, Any]) -> httpx.Response:
        """POST a batch, first moving the server clock up to its newest snapshot:
        agents push what they just collected."""
        newest = max((s["collected_at"] for s in body.get("snapshots", [])), default=0.0)
        self.clock.now = max(self.clock.now, newest)
        return self.client.post(
            "/api/v1/snapshots", json=body, headers={"Authorization": f"Bearer {token}"}
        )


@contextmanager
def serve(app: FastAPI) -> Iterator[str]:
    """Run ``app`` under uvicorn on an ephemeral port; stop it on exit."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(app, log_config=None, access_log=False, lifespan="on", ws="none")
    )
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
