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
"""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

_REQUEST_TIMEOUT = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\n"
    b"connection: close\r\ncontent-length: 36\r\n\r\nthe request did not arrive in time\r\n"
)


def bounded_protocol(arrival_seconds: float) -> type[asyncio.Protocol]:
    """uvicorn's httptools protocol, closing a connection whose request has not arrived
    within ``arrival_seconds``; for ``uvicorn.Config(http=...)``."""
    if not arrival_seconds > 0:
        raise ValueError("arrival_seconds must be positive")

    class BoundedHttpToolsProtocol(HttpToolsProtocol):
        _arrival: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._expect_arrival()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._expect_arrival()  # the next request on a kept-alive connection

        def on_message_complete(self) -> None:
            self._arrived()
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
                self.transport.write(_REQUEST_TIMEOUT)
            self.transport.close()

    return BoundedHttpToolsProtocol
