"""The agent's HTTP port, bounded: threads, time, and the policy of who may read what.

The port is reachable by anyone who can connect, so nothing a client does may hold
the agent's threads or memory for long. One thread per connection let 200 half-sent requests hold 200 threads. Now a single
thread (serve_forever) accepts connections and reads each request head into a small
buffer with a selector, costing no thread; only a complete head is handed to one of
``workers`` threads, which serves that one request and hands a keep-alive connection
back to the selector to wait for the next (with what the client already sent of it: a
pipelined request's head is read under the same rules). A head longer than
MAX_HEAD_BYTES gets 431 and the connection closes. Every stage has a deadline: the head must
arrive within ``header_timeout_seconds`` (``keepalive_idle_seconds`` for an idle
kept-alive connection), and a request in a worker is cut off (its socket shut down)
after ``request_timeout_seconds``. Past ``workers`` x QUEUE_PER_WORKER requests in
flight a new one gets 503 at once; past ``max_waiting_connections`` waiting heads the
oldest is closed.

Who may read what (:class:`PortPolicy`) is applied by the exporter's routes
(:mod:`gpuwatch.agent.exporter`).
"""

from __future__ import annotations

import contextlib
import io
import logging
import queue
import selectors
import socket
import socketserver
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from gpuwatch.settings import AgentSettings

log = logging.getLogger(__name__)

QUEUE_PER_WORKER = 4
MAX_HEAD_BYTES = 8 * 1024  # our clients send a few hundred bytes of headers
KEEPALIVE_IDLE_SECONDS = 30.0
SELECT_INTERVAL_SECONDS = 0.1  # how late a deadline may be noticed
SnapshotAccess = Literal["loopback", "token", "open"]


@dataclass(frozen=True)
class PortPolicy:
    """How many connections the port serves, for how long, and who may read what.

    ``snapshot_access``: ``/snapshot`` holds every user's full command lines, so by
    default only this host may read it (``loopback``); ``token`` also admits clients
    sending ``Authorization: Bearer <snapshot_token>``; ``open`` admits anyone.
    ``accept_oom_incidents`` false refuses ``POST /incidents/oom`` (403).
    ``allowed_hosts``: the ``Host`` names answered besides loopback ones
    (:mod:`gpuwatch.host_origin`).
    """

    workers: int = 8
    request_timeout_seconds: float = 10.0
    header_timeout_seconds: float = 5.0
    max_waiting_connections: int = 256
    snapshot_access: SnapshotAccess = "loopback"
    snapshot_token: str | None = None
    accept_oom_incidents: bool = True
    proc_root: Path = Path("/proc")
    allowed_hosts: tuple[str, ...] = ()

    @classmethod
    def from_settings(cls, settings: AgentSettings) -> PortPolicy:
        token = settings.snapshot_token
        return cls(
            workers=settings.http_workers,
            request_timeout_seconds=settings.http_request_timeout_seconds,
            header_timeout_seconds=min(5.0, settings.http_request_timeout_seconds),
            max_waiting_connections=settings.http_max_waiting_connections,
            snapshot_access=settings.snapshot_access,
            snapshot_token=token.get_secret_value() if token else None,
            accept_oom_incidents=settings.accept_oom_incidents,
            proc_root=settings.proc_root,
            allowed_hosts=tuple(settings.allowed_hosts),
        )


def _one_request_per_handoff(
    handler: type[BaseHTTPRequestHandler], header_timeout: float
) -> type[BaseHTTPRequestHandler]:
    """``handler`` serving the request whose head the selector read, then handing a
    kept-alive connection back to the selector instead of waiting on it."""

    class HandedOff(handler):  # type: ignore[valid-type,misc]
        server: BoundedHTTPServer
        handed_back = False
        leftover = b""

        def setup(self) -> None:
            self.connection = self.request
            self.connection.setblocking(True)
            self.connection.settimeout(header_timeout)
            if self.disable_nagle_algorithm:
                self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, True)
            prefix = self.server.take_head(self.connection)
            self.rfile = io.BufferedReader(_PrefixedReader(prefix, self.connection))
            self.wfile = _SocketWriter(self.connection)

        def handle(self) -> None:
            self.close_connection = True
            self.server.begin(self.connection)
            self.handle_one_request()
            if not self.close_connection:
                # The next request's head is read by the selector, under the same
                # limits as the first, starting from what the client already sent.
                self.leftover = self._take_buffered()
                self.handed_back = not self.close_connection

        def _take_buffered(self) -> bytes:
            """What the client sent past this request (its next request, pipelined),
            taken out of ``rfile``'s buffer without waiting for more."""
            self.connection.setblocking(False)
            try:
                buffered = self.rfile.peek(1)
                return self.rfile.read(len(buffered)) if buffered else b""
            except OSError:
                self.close_connection = True
                return b""
            finally:
                self.connection.setblocking(True)
                self.connection.settimeout(header_timeout)

    HandedOff.__name__ = HandedOff.__qualname__ = handler.__name__
    return HandedOff


class _PrefixedReader(io.RawIOBase):
    """A socket's bytes, after the head the selector already read from it."""

    def __init__(self, prefix: bytes, sock: socket.socket) -> None:
        self._prefix = memoryview(prefix)
        self._raw = socket.SocketIO(sock, "rb")

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int | None:
        if self._prefix:
            count = min(len(buffer), len(self._prefix))
            buffer[:count] = self._prefix[:count]
            self._prefix = self._prefix[count:]
            return count
        return self._raw.readinto(buffer)

    def close(self) -> None:
        self._raw.close()  # the socket stays open: the server owns it
        super().close()


class _SocketWriter(io.BufferedIOBase):
    """Unbuffered, complete writes (``sendall``), as :mod:`socketserver` does."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        self._sock.sendall(data)
        with memoryview(data) as view:
            return view.nbytes


_HEAD_TOO_LARGE = (
    b"HTTP/1.1 431 Request Header Fields Too Large\r\nContent-Type: application/json\r\n"
    b"Connection: close\r\nContent-Length: 37\r\n\r\n"
    b'{"error": "request head over 8 KiB"}\n'
)
_SERVICE_UNAVAILABLE = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
    b"Retry-After: 1\r\nConnection: close\r\nContent-Length: 40\r\n\r\n"
    b'{"error": "agent busy: try again soon"}\n'
)


class BoundedHTTPServer(HTTPServer):
    """An HTTP server with bounded threads and time (the section comment above)."""

    # socketserver's default backlog of 5 drops the SYNs of a burst of connections
    # (each then waits a 1 s retransmit) before the selector thread gets to accept them.
    request_queue_size = 128

    def __init__(
        self,
        address: tuple[str, int],
        handler: type[BaseHTTPRequestHandler],
        *,
        policy: PortPolicy,
    ) -> None:
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        self.policy = policy
        # Everything server_close() releases exists before binding: a failed bind calls it.
        self._selector = selectors.DefaultSelector()
        self._lock = threading.Lock()
        # Waiting for a complete head (no thread): socket -> (deadline, address, head so far).
        self._waiting: dict[socket.socket, tuple[float, Any, bytearray]] = {}
        self._heads: dict[socket.socket, bytes] = {}  # complete heads for the workers
        self._busy: dict[socket.socket, float] = {}  # in a worker: request deadline
        self._in_flight = 0
        # Kept-alive connections back from the workers, with what their client sent next.
        self._returned: queue.SimpleQueue[tuple[socket.socket, Any, bytes]] = queue.SimpleQueue()
        self._wake_read, self._wake_write = socket.socketpair()
        self._pool = ThreadPoolExecutor(policy.workers, thread_name_prefix="gpuwatch-http")
        self._stopping = threading.Event()
        self._stopped = threading.Event()
        self._stopped.set()
        self.refused_total = 0  # answered 503: too many requests in flight
        self.timed_out_total = 0  # closed at a deadline
        super().__init__(address, _one_request_per_handoff(handler, policy.header_timeout_seconds))

    def server_bind(self) -> None:
        # HTTPServer.server_bind also sets server_name to socket.getfqdn(host), which
        # only CGI reads: a reverse DNS lookup at every start (slow where DNS is) that
        # loads the idna codec and unicodedata, about 0.3 MiB of the agent's RSS.
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = self.socket.getsockname()[:2]

    # -- the selector thread ---------------------------------------------------------

    def serve_forever(self, poll_interval: float = SELECT_INTERVAL_SECONDS) -> None:
        self._stopped.clear()
        try:
            self.socket.setblocking(False)
            self._selector.register(self.socket, selectors.EVENT_READ, "listen")
            self._selector.register(self._wake_read, selectors.EVENT_READ, "wake")
            while not self._stopping.is_set():
                for key, _ in self._selector.select(timeout=poll_interval):
                    if key.data == "listen":
                        self._accept()
                    elif key.data == "wake":
                        self._drain_wakeups()
                    else:
                        self._read_head(key.fileobj)  # type: ignore[arg-type]
                self._take_back()
                self._expire(time.monotonic())
        finally:
            self._stopped.set()

    def shutdown(self) -> None:
        self._stopping.set()
        self._wake()
        self._stopped.wait()

    def server_close(self) -> None:
        super().server_close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            doomed = [*self._waiting, *self._busy]
            self._waiting.clear()
            self._busy.clear()
        for conn in doomed:
            _close(conn)
        self._selector.close()
        self._wake_read.close()
        self._wake_write.close()

    def _accept(self) -> None:
        for _ in range(64):  # drain the backlog, a burst at a time
            try:
                conn, address = self.socket.accept()
            except OSError:
                return
            if len(self._waiting) >= self.policy.max_waiting_connections:
                self._drop(next(iter(self._waiting)))  # the oldest waiting head
            self._wait_for_head(conn, address, self.policy.header_timeout_seconds)

    def _wait_for_head(
        self, conn: socket.socket, address: Any, timeout: float, sent: bytes = b""
    ) -> None:
        conn.setblocking(False)
        self._waiting[conn] = (time.monotonic() + timeout, address, bytearray())
        self._selector.register(conn, selectors.EVENT_READ, address)
        if sent:  # a pipelined request: the selector will not signal what already came
            self._add_to_head(conn, sent)

    def _read_head(self, conn: socket.socket) -> None:
        head = self._waiting[conn][2]
        try:
            chunk = conn.recv(max(1, MAX_HEAD_BYTES - len(head)))
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if not chunk:
            self._drop(conn)  # the client went away
            return
        self._add_to_head(conn, chunk)

    def _add_to_head(self, conn: socket.socket, chunk: bytes) -> None:
        deadline, address, head = self._waiting[conn]
        if not head:  # an idle kept-alive connection starts a request: its head timer
            deadline = min(deadline, time.monotonic() + self.policy.header_timeout_seconds)
        head += chunk
        self._waiting[conn] = (deadline, address, head)
        end = head.find(b"\r\n\r\n")
        if end != -1 and end + 4 <= MAX_HEAD_BYTES:
            self._selector.unregister(conn)
            del self._waiting[conn]
            self._dispatch(conn, address, bytes(head))
        elif len(head) >= MAX_HEAD_BYTES:
            # A head this long is no client of ours; reading the rest in a worker
            # would make the limit none.
            self.refused_total += 1
            with contextlib.suppress(OSError):
                conn.send(_HEAD_TOO_LARGE)
            self._drop(conn)

    def _dispatch(self, conn: socket.socket, address: Any, head: bytes) -> None:
        with self._lock:
            full = self._in_flight >= self.policy.workers * QUEUE_PER_WORKER
            if not full:
                self._in_flight += 1
                self._heads[conn] = head
        if full:
            self.refused_total += 1
            with contextlib.suppress(OSError):
                conn.send(_SERVICE_UNAVAILABLE)  # fits in an empty send buffer
            _close(conn)
            return
        self._pool.submit(self._serve, conn, address)

    def _take_back(self) -> None:
        while True:
            try:
                conn, address, sent = self._returned.get_nowait()
            except queue.Empty:
                return
            self._wait_for_head(conn, address, KEEPALIVE_IDLE_SECONDS, sent)

    def _expire(self, now: float) -> None:
        for conn in [c for c, (deadline, _, _) in self._waiting.items() if deadline <= now]:
            self.timed_out_total += 1
            self._drop(conn)
        with self._lock:
            late = [c for c, deadline in self._busy.items() if deadline <= now]
            for conn in late:
                del self._busy[conn]
        for conn in late:
            # Unblocks the worker's read or write; it then ends the request.
            self.timed_out_total += 1
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)

    def _drop(self, conn: socket.socket) -> None:
        self._waiting.pop(conn, None)
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(conn)
        _close(conn)

    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            self._wake_write.send(b"x")

    def _drain_wakeups(self) -> None:
        with contextlib.suppress(OSError):
            self._wake_read.recv(4096)

    # -- the workers -----------------------------------------------------------------

    def take_head(self, conn: socket.socket) -> bytes:
        with self._lock:
            return self._heads.pop(conn, b"")

    def begin(self, conn: socket.socket) -> None:
        """A request starts on ``conn``: it must be answered by the request deadline."""
        with self._lock:
            self._busy[conn] = time.monotonic() + self.policy.request_timeout_seconds

    def _serve(self, conn: socket.socket, address: Any) -> None:
        handed_back = False
        sent = b""
        try:
            handler = self.RequestHandlerClass(conn, address, self)  # type: ignore[arg-type]
            handed_back = bool(getattr(handler, "handed_back", False))
            sent = getattr(handler, "leftover", b"")
        except Exception as err:  # a client that vanished mid-response, a cut-off request
            log.debug("connection from %s ended: %s", address, err)
        finally:
            with self._lock:
                self._in_flight -= 1
                timed_out = self._busy.pop(conn, None) is None
                self._heads.pop(conn, None)
            if handed_back and not timed_out and not self._stopping.is_set():
                self._returned.put((conn, address, sent))
                self._wake()
            else:
                _close(conn)


def _close(conn: socket.socket) -> None:
    with contextlib.suppress(OSError):
        conn.close()
