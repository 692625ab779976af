"""The agent's HTTP endpoint: ``/metrics`` for Prometheus, plus a small local API.

=====================  ==========================================================
``GET /metrics``       Prometheus exposition (OpenMetrics when asked; gzip when asked)
``GET /snapshot``      the latest :class:`~gpuwatch.snapshot.HostSnapshot` as JSON
``GET /healthz``       200 while polls succeed, 503 before the first or when stale
``GET /reaper/history`` the reaper's activity history (``?pid=N`` for one process)
``POST /torch``        allocator figures from ``gpuwatch.torch`` (loopback only)
``POST /incidents/oom`` an OOM incident from ``gpuwatch.torch`` (loopback only)
=====================  ==========================================================

The POST bodies are :class:`~gpuwatch.wire.TorchReport` and
:class:`~gpuwatch.wire.OomIncident`, bounded by the limits in :mod:`gpuwatch.wire`.

The POST endpoints accept only loopback clients: they take data from processes on
this host, and a remote peer must not be able to invent allocator figures or
incidents even when ``/metrics`` listens on all interfaces for Prometheus.
Bodies are bounded and validated; bad input gets a 4xx with a one-line reason.

Bounds and access (:class:`PortPolicy`, from the agent's settings): a fixed pool of
worker threads, request heads read without a thread, a deadline on every request
(:class:`BoundedHTTPServer`); ``/snapshot`` (every user's full command lines) readable
from this host only unless ``snapshot_access`` says otherwise; OOM incidents refused
when ``accept_oom_incidents`` is off, and otherwise tagged with who posted them
(:class:`IncidentOrigin`): any local user can post over TCP loopback, and the agent
forwards under the host's token.
"""

from __future__ import annotations

import contextlib
import gzip
import hmac
import io
import ipaddress
import json
import logging
import pwd
import queue
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar
from urllib.parse import parse_qs

from pydantic import BaseModel, ValidationError

from gpuwatch.agent.reaper.served import HISTORY_PATH
from gpuwatch.agent.state import AgentState
from gpuwatch.agent.torch_reports import TorchReports
from gpuwatch.wire import (
    INCIDENTS_OOM_PATH,
    MAX_INCIDENT_BODY,
    MAX_TORCH_BODY,
    TORCH_PATH,
    OomIncident,
    TorchReport,
)

if TYPE_CHECKING:
    from gpuwatch.settings import AgentSettings

log = logging.getLogger(__name__)

_Body = TypeVar("_Body", bound=BaseModel)

# /healthz turns unhealthy when the newest poll is older than this many intervals.
STALE_POLL_INTERVALS = 3


class Exporter:
    """Serves the agent's endpoints on ``(host, port)`` from a background thread."""

    def __init__(
        self,
        address: tuple[str, int],
        *,
        render_metrics: Callable[[str], tuple[bytes, str]],
        state: AgentState,
        torch_reports: TorchReports,
        poll_interval_seconds: float,
        on_oom: Callable[[OomIncident], None] | None = None,
        history: Callable[[int | None], bytes] | None = None,
        clock: Callable[[], float] = time.time,
        policy: PortPolicy | None = None,
        on_oom_from: Callable[[OomIncident, IncidentOrigin], None] | None = None,
    ) -> None:
        """``policy`` bounds the port and guards ``/snapshot`` (default: 8 workers,
        10 s per request, snapshot for this host only). ``on_oom_from``, when given,
        receives each incident with its :class:`IncidentOrigin` instead of ``on_oom``."""
        handler = _handler_class(
            render_metrics=render_metrics,
            state=state,
            torch_reports=torch_reports,
            stale_after=poll_interval_seconds * STALE_POLL_INTERVALS,
            on_oom=_forwarder(on_oom, on_oom_from),
            history=history,
            clock=clock,
        )
        self._server = BoundedHTTPServer(address, handler, policy=policy or PortPolicy())
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        host = str(host)
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    def start(self) -> None:
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="gpuwatch-exporter", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)


def _handler_class(
    *,
    render_metrics: Callable[[str], tuple[bytes, str]],
    state: AgentState,
    torch_reports: TorchReports,
    stale_after: float,
    on_oom: Callable[[OomIncident], None] | None,
    history: Callable[[int | None], bytes] | None,
    clock: Callable[[], float],
) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "gpuwatch-agent"
        protocol_version = "HTTP/1.1"
        # Headers and body go out in separate writes; with Nagle on, a keep-alive client's
        # delayed ACK stalls every response by ~40 ms (measured in bench/agent.py).
        disable_nagle_algorithm = True

        def log_message(self, format: str, *args: Any) -> None:
            log.debug("%s %s", self.address_string(), format % args)

        # -- helpers -------------------------------------------------------------------

        def _send(
            self, status: int, body: bytes, content_type: str, headers: dict[str, str] | None = None
        ) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            for key, value in (headers or {}).items():
                self.send_header(key, value)
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _error(self, status: int, message: str) -> None:
            self._send(status, json.dumps({"error": message}).encode() + b"\n", "application/json")

        def _read_body(self, limit: int) -> bytes | None:
            """The request body, or ``None`` after answering with an error."""
            if not _is_loopback(self.client_address[0]):
                self._error(403, "only local processes may post to the agent")
                return None
            length_header = self.headers.get("Content-Length")
            if length_header is None or not length_header.isdigit():
                self._error(411, "Content-Length required")
                return None
            length = int(length_header)
            if length > limit:
                # Answer before reading: an oversized body is never buffered.
                self.close_connection = True
                self._error(413, f"body larger than {limit} bytes")
                return None
            return self.rfile.read(length)

        def _read_model(self, model: type[_Body], limit: int) -> _Body | None:
            """The body validated as ``model``, or ``None`` after answering with an error:
            400 when it is not JSON, 422 when it is JSON of another shape."""
            raw = self._read_body(limit)
            if raw is None:
                return None
            try:
                data = json.loads(raw)
            except (UnicodeDecodeError, json.JSONDecodeError) as err:
                self._error(400, f"body is not JSON: {err}")
                return None
            try:
                return model.model_validate(data)
            except ValidationError as err:
                self._error(422, _first_error(err))
                return None

        # -- routes --------------------------------------------------------------------

        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                self._metrics()
            elif path == "/snapshot":
                current = state.current
                if current is None:
                    reason = (
                        "no poll has completed yet"
                        if state.latest is None
                        else ("the last poll failed; the previous one is stale")
                    )
                    self._error(503, reason)
                else:
                    self._send(200, current.model_dump_json().encode(), "application/json")
            elif path == "/healthz":
                latest = state.latest
                if latest is None or clock() - latest.collected_at > stale_after:
                    self._error(503, "no recent successful poll")
                else:
                    self._send(200, b"ok\n", "text/plain; charset=utf-8")
            elif path == HISTORY_PATH and history is not None:
                query = parse_qs(self.path.partition("?")[2])
                pid = query.get("pid", [""])[0]
                if pid and not pid.isdigit():
                    self._error(400, "pid must be a number")
                else:
                    self._send(200, history(int(pid) if pid else None), "application/json")
            elif path == "/":
                self._send(200, _INDEX, "text/html; charset=utf-8")
            else:
                self._error(404, f"no such endpoint: {path}")

        do_HEAD = do_GET

        def _metrics(self) -> None:
            body, content_type = render_metrics(self.headers.get("Accept", ""))
            headers = {}
            if "gzip" in self.headers.get("Accept-Encoding", ""):
                body = gzip.compress(body, compresslevel=1)
                headers["Content-Encoding"] = "gzip"
            self._send(200, body, content_type, headers)

        def do_POST(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == TORCH_PATH:
                report = self._read_model(TorchReport, MAX_TORCH_BODY)
                if report is None:
                    return
                torch_reports.record(report)
                self._send(204, b"", "text/plain")
            elif path == INCIDENTS_OOM_PATH:
                incident = self._read_model(OomIncident, MAX_INCIDENT_BODY)
                if incident is None:
                    return
                if on_oom is not None:
                    on_oom(incident)
                self._send(202, b'{"accepted": true}\n', "application/json")
            else:
                self._error(404, f"no such endpoint: {path}")

    return Handler


_PRIVATE_PATHS = ("/snapshot", "/reaper/history")


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _first_error(err: ValidationError) -> str:
    first = err.errors()[0]
    where = ".".join(str(p) for p in first["loc"]) or "body"
    return f"{where}: {first['msg']}"


_INDEX = b"""<!doctype html><title>gpuwatch agent</title>
<h1>gpuwatch agent</h1>
<ul><li><a href="/metrics">/metrics</a></li><li><a href="/snapshot">/snapshot</a></li>
<li><a href="/healthz">/healthz</a></li></ul>
"""


# -- bounds and access (the port is reachable by anyone who can connect) -----------------
#
# One thread per connection let 200 half-sent requests hold 200 threads. Now a single
# thread (serve_forever) accepts connections and reads each request head into a small
# buffer with a selector, costing no thread; only a complete head is handed to one of
# ``workers`` threads, which serves that one request and hands a keep-alive connection
# back to the selector to wait for the next. Every stage has a deadline: the head must
# arrive within ``header_timeout_seconds`` (``keepalive_idle_seconds`` for an idle
# kept-alive connection), and a request in a worker is cut off (its socket shut down)
# after ``request_timeout_seconds``. Past ``workers`` x QUEUE_PER_WORKER requests in
# flight a new one gets 503 at once; past ``max_waiting_connections`` waiting heads the
# oldest is closed.

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
    """

    workers: int = 8
    request_timeout_seconds: float = 10.0
    header_timeout_seconds: float = 5.0
    max_waiting_connections: int = 256
    snapshot_access: SnapshotAccess = "loopback"
    snapshot_token: str | None = None
    accept_oom_incidents: bool = True
    proc_root: Path = Path("/proc")

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
        )


@dataclass(frozen=True)
class IncidentOrigin:
    """Who posted an OOM incident: always this host (loopback), and which user.

    Any local user can post one, and the agent forwards it under the host's token, so
    the event says it was reported by the agent from a local process, with the
    poster's uid as the kernel knows it (``/proc/net/tcp``), not as the body claims.
    """

    peer_address: str
    peer_uid: int | None
    peer_user: str | None
    reported_by: str = "agent-local"

    def evidence(self) -> dict[str, Any]:
        return {
            "reported_by": self.reported_by,
            "reporter_uid": self.peer_uid,
            "reporter_user": self.peer_user,
        }


def tcp_peer_uid(
    client: tuple[str, int], server: tuple[str, int], *, proc_root: Path = Path("/proc")
) -> int | None:
    """The uid owning the client end of a local TCP connection, from ``/proc/net/tcp{,6}``.

    On loopback both ends are this host's sockets: the client's row has ``local_address``
    = client and ``rem_address`` = server. ``None`` when not found or not readable.
    """
    try:
        local = ipaddress.ip_address(client[0])
        remote = ipaddress.ip_address(server[0])
    except ValueError:
        return None
    if local.version != remote.version:
        return None
    table = "tcp" if local.version == 4 else "tcp6"
    want = (_proc_net_address(local, client[1]), _proc_net_address(remote, server[1]))
    try:
        lines = (proc_root / "net" / table).read_text(encoding="ascii").splitlines()[1:]
    except (OSError, UnicodeDecodeError):
        return None
    for line in lines:
        fields = line.split()
        if len(fields) > 7 and (fields[1], fields[2]) == want and fields[7].isdigit():
            return int(fields[7])
    return None


def _proc_net_address(address: ipaddress.IPv4Address | ipaddress.IPv6Address, port: int) -> str:
    # The kernel prints each 32-bit word of the address in host byte order, in hex.
    packed = address.packed
    words = struct.unpack(f"={len(packed) // 4}I", packed)
    return "".join(f"{word:08X}" for word in words) + f":{port:04X}"


def _user_name(uid: int | None) -> str | None:
    if uid is None:
        return None
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return None


# The incident's origin, set by the guarded handler for the request being served.
_request = threading.local()


def _forwarder(
    on_oom: Callable[[OomIncident], None] | None,
    on_oom_from: Callable[[OomIncident, IncidentOrigin], None] | None,
) -> Callable[[OomIncident], None] | None:
    """The ``on_oom`` the route calls: logs who posted, then hands the incident on."""
    if on_oom is None and on_oom_from is None:
        return None

    def forward(incident: OomIncident) -> None:
        origin: IncidentOrigin = _request.origin
        log.warning(
            "OOM incident posted from %s by uid %s (%s), for pid %s",
            origin.peer_address,
            origin.peer_uid,
            origin.peer_user,
            incident.pid,
        )
        if on_oom_from is not None:
            on_oom_from(incident, origin)
        elif on_oom is not None:
            on_oom(incident)

    return forward


def _guarded(
    handler: type[BaseHTTPRequestHandler], policy: PortPolicy
) -> type[BaseHTTPRequestHandler]:
    """``handler`` serving one request per hand-off, with the access rules applied
    before any route runs (the routes themselves are unchanged)."""

    class Guarded(handler):  # type: ignore[valid-type,misc]
        server: BoundedHTTPServer
        handed_back = False

        def setup(self) -> None:
            self.connection = self.request
            self.connection.setblocking(True)
            self.connection.settimeout(policy.header_timeout_seconds)
            if self.disable_nagle_algorithm:
                self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, True)
            prefix = self.server.take_head(self.connection)
            self.rfile = io.BufferedReader(_PrefixedReader(prefix, self.connection))
            self.wfile = _SocketWriter(self.connection)

        def handle(self) -> None:
            self.close_connection = True
            self.server.begin(self.connection)
            self.handle_one_request()
            while not self.close_connection:
                if not self._next_request_buffered():
                    # Wait for the next request in the selector, not in this thread.
                    self.handed_back = True
                    return
                self.server.begin(self.connection)
                self.handle_one_request()

        def _next_request_buffered(self) -> bool:
            """True when the client already sent (part of) its next request; it was
            read into ``rfile``'s buffer, so this thread must serve it."""
            self.connection.setblocking(False)
            try:
                return bool(self.rfile.peek(1))
            except OSError:
                self.close_connection = True
                return False
            finally:
                self.connection.setblocking(True)
                self.connection.settimeout(policy.header_timeout_seconds)

        def parse_request(self) -> bool:
            if not super().parse_request():
                return False
            path = self.path.split("?", 1)[0]
            # /reaper/history names every process's PIDs, GPUs and activity: the same
            # rule as the snapshot.
            if self.command in ("GET", "HEAD") and path in _PRIVATE_PATHS:
                if not self._may_read_snapshot():
                    self._error(403, _SNAPSHOT_REFUSED[policy.snapshot_access])
                    return False
            elif self.command == "POST" and path == INCIDENTS_OOM_PATH:
                if not policy.accept_oom_incidents:
                    self._error(
                        403, "this agent does not accept OOM incidents (accept_oom_incidents)"
                    )
                    return False
                _request.origin = self._origin()
            return True

        def _may_read_snapshot(self) -> bool:
            if policy.snapshot_access == "open" or _is_loopback(self.client_address[0]):
                return True
            if policy.snapshot_access != "token" or not policy.snapshot_token:
                return False
            given = self.headers.get("Authorization", "")
            expected = f"Bearer {policy.snapshot_token}"
            return hmac.compare_digest(given.encode(), expected.encode())

        def _origin(self) -> IncidentOrigin:
            client = (str(self.client_address[0]), int(self.client_address[1]))
            local = self.connection.getsockname()
            uid = tcp_peer_uid(client, (local[0], local[1]), proc_root=policy.proc_root)
            return IncidentOrigin(f"{client[0]}:{client[1]}", uid, _user_name(uid))

        def _error(self, status: int, message: str) -> None:  # routes define it too
            super()._error(status, message)  # type: ignore[misc]

    Guarded.__name__ = Guarded.__qualname__ = handler.__name__
    return Guarded


_SNAPSHOT_REFUSED = {
    "loopback": "/snapshot holds every user's command lines: only this host may read it "
    "(snapshot_access)",
    "token": "/snapshot needs Authorization: Bearer <snapshot_token> from other hosts",
    "open": "",
}


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
        self._returned: queue.SimpleQueue[tuple[socket.socket, Any]] = queue.SimpleQueue()
        self._wake_read, self._wake_write = socket.socketpair()
        self._pool = ThreadPoolExecutor(policy.workers, thread_name_prefix="gpuwatch-http")
        self._stopping = threading.Event()
        self._stopped = threading.Event()
        self._stopped.set()
        self.refused_total = 0  # answered 503: too many requests in flight
        self.timed_out_total = 0  # closed at a deadline
        super().__init__(address, _guarded(handler, policy))

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

    def _wait_for_head(self, conn: socket.socket, address: Any, timeout: float) -> None:
        conn.setblocking(False)
        self._waiting[conn] = (time.monotonic() + timeout, address, bytearray())
        self._selector.register(conn, selectors.EVENT_READ, address)

    def _read_head(self, conn: socket.socket) -> None:
        deadline, address, head = self._waiting[conn]
        try:
            chunk = conn.recv(MAX_HEAD_BYTES - len(head))
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if not chunk:
            self._drop(conn)  # the client went away
            return
        if not head:  # an idle kept-alive connection starts a request: its head timer
            deadline = min(deadline, time.monotonic() + self.policy.header_timeout_seconds)
        head += chunk
        self._waiting[conn] = (deadline, address, head)
        if b"\r\n\r\n" in head or len(head) >= MAX_HEAD_BYTES:
            self._selector.unregister(conn)
            del self._waiting[conn]
            self._dispatch(conn, address, bytes(head))

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
                conn, address = self._returned.get_nowait()
            except queue.Empty:
                return
            self._wait_for_head(conn, address, KEEPALIVE_IDLE_SECONDS)

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
        try:
            handler = self.RequestHandlerClass(conn, address, self)  # type: ignore[arg-type]
            handed_back = bool(getattr(handler, "handed_back", False))
        except Exception as err:  # a client that vanished mid-response, a cut-off request
            log.debug("connection from %s ended: %s", address, err)
        finally:
            with self._lock:
                self._in_flight -= 1
                timed_out = self._busy.pop(conn, None) is None
                self._heads.pop(conn, None)
            if handed_back and not timed_out and not self._stopping.is_set():
                self._returned.put((conn, address))
                self._wake()
            else:
                _close(conn)


def _close(conn: socket.socket) -> None:
    with contextlib.suppress(OSError):
        conn.close()
