"""Test harness for the server: an injectable clock, tokens, a live uvicorn server."""

from __future__ import annotations

import asyncio
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


# How often the test server looks for ``should_exit`` and for connections still open
# while it stops. uvicorn polls both every 0.1 s and sleeps a fixed 0.1 s more in its
# shutdown: about 0.15-0.3 s per test, for several hundred tests that each stop one.
_STOP_POLL_SECONDS = 0.005


class _Server(uvicorn.Server):
    """uvicorn's server, stopping in the same steps (stop accepting, ask each open
    connection to finish, wait for connections and tasks, then the app's lifespan
    shutdown) but noticing each step's end within milliseconds instead of 0.1 s."""

    async def main_loop(self) -> None:
        counter = 0
        should_exit = await self.on_tick(counter)
        while not should_exit:
            # uvicorn's tick stays 0.1 s (its Date header, its request limit); only the
            # look at should_exit comes more often.
            for _ in range(20):
                if self.should_exit:
                    break
                await asyncio.sleep(_STOP_POLL_SECONDS)
            counter = (counter + 1) % 864000
            should_exit = await self.on_tick(counter)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        for listener in self.servers:
            listener.close()
        for sock in sockets or []:
            sock.close()
        for connection in list(self.server_state.connections):
            connection.shutdown()
        await asyncio.sleep(0)  # let each connection act on its shutdown request
        try:
            async with asyncio.timeout(self.config.timeout_graceful_shutdown):
                while self.server_state.connections and not self.force_exit:
                    await asyncio.sleep(_STOP_POLL_SECONDS)
                while self.server_state.tasks and not self.force_exit:
                    await asyncio.sleep(_STOP_POLL_SECONDS)
                for listener in self.servers:
                    await listener.wait_closed()
        except TimeoutError:
            for task in self.server_state.tasks:
                task.cancel(msg="Task cancelled, timeout graceful shutdown exceeded")
        if not self.force_exit:
            await self.lifespan.shutdown()


@contextmanager
def serve(app: FastAPI) -> Iterator[str]:
    """Run ``app`` under uvicorn on an ephemeral port; stop it on exit."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = _Server(
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
