"""Fixtures for the doctor and torch-reporter tests: a real local agent stand-in."""

from __future__ import annotations

from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from doctor.fake_agent_server import FakeAgent, start


@pytest.fixture
def agent() -> Iterator[FakeAgent]:
    state = FakeAgent()
    server, thread = start(state)
    try:
        yield state
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


@pytest.fixture
def no_agent_url() -> str:
    """A URL where nothing listens: a port that was free a moment ago."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler)
    port = server.server_address[1]
    server.server_close()
    return f"http://127.0.0.1:{port}"
