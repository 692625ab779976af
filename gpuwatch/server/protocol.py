"""uvicorn's HTTP protocol, with a bound on the time a request may take to arrive.

uvicorn closes a keep-alive connection that sits idle between requests
(``timeout_keep_alive``), but waits for ever for a request that has begun and for a
connection that sends nothing. Anyone who can reach the port, no token needed, could
open connections and send half a request line: each held a file descriptor and a
protocol object for good, until the server could accept no one else (the agent's own
port had the same hole: gpuwatch/agent/port.py). Here a connection whose request, head
and body, has not wholly arrived within ``request_arrival_seconds`` of its first byte
(of the connection, for its first request) is answered 408 and closed, or only closed
when the application is already reading it. Ingest and event bodies have a shorter
bound of their own, answered 503 (ingest/body.py).

The head (request line and headers) is bounded in size too, at :data:`MAX_HEAD_BYTES`:
uvicorn gathers the URL and the headers with no limit, so before any token was read, a
client could make the server hold whatever it sent in 10 s (90 MiB of URL from one
connection, measured). Past the bound: 431, and the connection closed.
"""

from __future__ import annotations

import asyncio
from typing import Any, Literal

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

# Seconds a refused connection is still read from (and what comes dropped) after its
# answer, before it is closed.
LINGER_SECONDS = 2.0
# The web dashboard's longest URL (the events page with every filter, or a login's
# ``next``) is under 4 KiB; a browser's cookies and an agent's token a few more.
MAX_HEAD_BYTES = 64 * 2**10


def _answer(status: str, text: str) -> bytes:
    body = text.encode() + b"\r\n"
    return (
        f"HTTP/1.1 {status}\r\ncontent-type: text/plain; charset=utf-8\r\n"
        f"connection: close\r\ncontent-length: {len(body)}\r\n\r\n"
    ).encode() + body


_REQUEST_TIMEOUT = _answer("408 Request Timeout", "the request did not arrive in time")
_HEAD_TOO_LARGE = _answer(
    "431 Request Header Fields Too Large",
    f"the request line and headers exceed {MAX_HEAD_BYTES} bytes",
)


def bounded_protocol(arrival_seconds: float) -> type[asyncio.Protocol]:
    """uvicorn's httptools protocol, closing a connection whose request has not arrived
    within ``arrival_seconds`` or whose head is over :data:`MAX_HEAD_BYTES`; for
    ``uvicorn.Config(http=...)``."""
    if not arrival_seconds > 0:
        raise ValueError("arrival_seconds must be positive")

    class BoundedHttpToolsProtocol(HttpToolsProtocol):
        _arrival: asyncio.TimerHandle | None = None
        _head_bytes = 0
        _refused = False

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._expect_arrival()

        def data_received(self, data: bytes) -> None:
            if not self._refused:  # else read and dropped until the connection closes
                super().data_received(data)

        # The parser goes on through the rest of the bytes it was fed: once the request
        # is refused, none of it reaches uvicorn's request handling.
        def on_headers_complete(self) -> None:
            if not self._refused:
                super().on_headers_complete()

        def on_body(self, body: bytes) -> None:
            if not self._refused:
                super().on_body(body)

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._head_bytes = 0
            self._expect_arrival()  # the next request on a kept-alive connection

        def on_url(self, url: bytes) -> None:
            if self._within_head(len(url)):
                super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            if self._within_head(len(name) + len(value)):
                super().on_header(name, value)

        def _within_head(self, more: int) -> bool:
            self._head_bytes += more
            if self._head_bytes <= MAX_HEAD_BYTES:
                return True
            self._refuse(_HEAD_TOO_LARGE)
            return False

        def _refuse(self, answer: bytes) -> None:
            """Answer, then close. Closing a socket with unread bytes in it sends a
            reset, which can destroy the answer before the client reads it: so the
            write side is shut first and what still comes is read and dropped, for at
            most :data:`LINGER_SECONDS`, as nginx's lingering close does."""
            if self._refused or self.transport.is_closing():
                return
            self._refused = True
            self._arrived()
            self.transport.write(answer)
            if self.transport.can_write_eof():
                self.transport.write_eof()
            self.loop.call_later(LINGER_SECONDS, self.transport.close)

        def on_message_complete(self) -> None:
            self._arrived()
            if not self._refused:
                super().on_message_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._arrived()
            super().connection_lost(exc)

        def _expect_arrival(self) -> None:
            if self._arrival is None:
                self._arrival = self.loop.call_later(arrival_seconds, self._too_late)

        def _arrived(self) -> None:
            if self._arrival is not None:
                self._arrival.cancel()
                self._arrival = None

        def _too_late(self) -> None:
            self._arrival = None
            if self.transport.is_closing():
                return
            # No request of this connection in the application's hands (its head is
            # still arriving): it can be answered. Otherwise the application is reading
            # its body and answers for itself, once it sees the connection gone.
            if self.cycle is None or self.cycle.response_complete:
                self._refuse(_REQUEST_TIMEOUT)
            else:
                self.transport.close()

    return BoundedHttpToolsProtocol


def server_config(
    app: Any, *, arrival_seconds: float, lifespan: Literal["on", "off"] = "on"
) -> uvicorn.Config:
    """How ``gpuwatch server`` runs ``app`` under uvicorn; the benchmarks' HTTP floor
    (bench/http_floor.py) uses it too, so the two differ only in the app. Our logging
    config stays in charge (``log_config=None``; the access log is logger
    "uvicorn.access" at INFO); HTTP is parsed by httptools with the bounds above."""
    return uvicorn.Config(
        app,
        http=bounded_protocol(arrival_seconds),
        log_config=None,
        lifespan=lifespan,
        ws="none",
        proxy_headers=False,
    )
