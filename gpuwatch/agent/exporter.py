"""The agent's HTTP endpoint: ``/metrics`` for Prometheus, plus a small local API.

=====================  ==========================================================
``GET /metrics``       Prometheus exposition (OpenMetrics when asked; gzip when asked)
``GET /snapshot``      the latest :class:`~gpuwatch.snapshot.HostSnapshot` as JSON
``GET /healthz``       200 while polls succeed, 503 before the first or when stale;
                       200 ``degraded: ...`` while the spool cannot be written
``GET /reaper/history`` the reaper's activity history (``?pid=N`` for one process)
``POST /torch``        allocator figures from ``gpuwatch.torch`` (loopback only)
``POST /incidents/oom`` an OOM incident from ``gpuwatch.torch`` (loopback only)
=====================  ==========================================================

The POST bodies are :class:`~gpuwatch.wire.TorchReport` and
:class:`~gpuwatch.wire.OomIncident`, bounded by the limits in :mod:`gpuwatch.wire`.

The POST endpoints accept only loopback clients: they take data from processes on
this host, and a remote peer must not be able to invent allocator figures or
incidents even when ``/metrics`` listens on all interfaces for Prometheus.
Bodies are bounded and validated; bad input gets a 4xx with a one-line reason. An
allocator report is taken only from its process's owner or root (the poster's uid as
the kernel knows it, :func:`torch_report_refusal`; 403 otherwise), and each poster
holds a bounded share of the reports kept (:mod:`gpuwatch.agent.torch_reports`).

Bounds and access (:class:`~gpuwatch.agent.port.PortPolicy`, from the agent's
settings): a fixed pool of worker threads, request heads read without a thread, a
deadline on every request (:mod:`gpuwatch.agent.port`); ``/snapshot`` (every user's full command lines) readable
from this host only unless ``snapshot_access`` says otherwise; OOM incidents refused
when ``accept_oom_incidents`` is off, and otherwise tagged with who posted them
(:mod:`gpuwatch.agent.incident_origin`): any local user can post over TCP loopback, and the agent
forwards under the host's token. So each poster (uid, as the kernel knows it) may post
:data:`OOM_POSTS_BURST` incidents at once and then one every
``1 / OOM_POSTS_PER_SECOND`` seconds (:class:`PosterRateLimit`); past that it gets 429
with ``Retry-After`` before its body is read, and the connection closes. What is taken
is forwarded by the agent's one event sender, whose queue is bounded
(:mod:`gpuwatch.agent.push`): no post costs a thread, and none holds memory for long.

Web pages in a browser on this host (:mod:`gpuwatch.host_origin`, before any route):
on a loopback listener a ``Host`` other than ``localhost``, a loopback address or one
of ``allowed_hosts`` gets 421 (DNS rebinding); a POST from another site (``Origin``,
``Sec-Fetch-Site``) gets 403; an OOM incident not sent as ``application/json`` gets
415 (a page may send ``text/plain`` anywhere without a CORS preflight). Each is refused
before the poster's uid is looked up, and closes the connection (its body is unread).
"""

from __future__ import annotations

import gzip
import hmac
import json
import logging
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import parse_qs

from pydantic import BaseModel, ValidationError

from gpuwatch.agent.incident_origin import IncidentOrigin
from gpuwatch.agent.port import BoundedHTTPServer, PortPolicy
from gpuwatch.agent.procinfo import process_uid
from gpuwatch.agent.reaper.served import HISTORY_PATH
from gpuwatch.agent.state import AgentState
from gpuwatch.agent.torch_reports import TorchReports
from gpuwatch.host_origin import RequestGuard, is_loopback_address
from gpuwatch.ratelimit import TokenBucket, refill
from gpuwatch.wire import (
    INCIDENTS_OOM_PATH,
    MAX_INCIDENT_BODY,
    MAX_TORCH_BODY,
    TORCH_PATH,
    OomIncident,
    TorchReport,
    is_json_media_type,
)

if TYPE_CHECKING:
    pass

log = logging.getLogger(__name__)

# OOM incidents one poster (uid) may send: ten at once (the ranks of a job failing
# together), then one every 6 s. A process's real OOMs are rarer than that.
OOM_POSTS_BURST = 10.0
OOM_POSTS_PER_SECOND = 1 / 6
# Posters remembered; past it the least recently seen starts again with a full burst
# (only root can post as many uids).
MAX_POSTERS = 1024


class PosterRateLimit:
    """A token bucket per poster uid (``None``: a poster the kernel did not name, all
    in one bucket), on a monotonic ``clock``."""

    def __init__(
        self,
        *,
        burst: float = OOM_POSTS_BURST,
        per_second: float = OOM_POSTS_PER_SECOND,
        clock: Callable[[], float] = time.monotonic,
        max_posters: int = MAX_POSTERS,
    ) -> None:
        self._burst = burst
        self._per_second = per_second
        self._clock = clock
        self._max_posters = max_posters
        self._buckets: OrderedDict[int | None, TokenBucket] = OrderedDict()
        self._lock = threading.Lock()
        self.refused_total = 0

    def take(self, uid: int | None) -> float | None:
        """Take one post for ``uid``: ``None`` when it may post now, else the seconds
        until it may (nothing taken)."""
        now = self._clock()
        with self._lock:
            bucket = self._buckets.pop(uid, None) or TokenBucket(units=self._burst, at=now)
            refill(bucket, now=now, burst=self._burst, per_second=self._per_second)
            self._buckets[uid] = bucket
            if bucket.units >= 1.0:
                bucket.units -= 1.0
                wait = None
            else:
                self.refused_total += 1
                wait = (1.0 - bucket.units) / self._per_second
            while len(self._buckets) > self._max_posters:
                self._buckets.popitem(last=False)
        return wait


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
        oom_posts: PosterRateLimit | None = None,
        spool_problem: Callable[[], str | None] | None = None,
    ) -> None:
        """``spool_problem``, when given, says why the spool refuses writes (None while
        it works): ``/healthz`` then answers 200 ``degraded: ...``, not 503, since the
        agent still polls and sends from memory, and a restart would lose that.
        ``policy`` bounds the port and guards ``/snapshot`` (default: 8 workers,
        10 s per request, snapshot for this host only). ``on_oom_from``, when given,
        receives each incident with its :class:`IncidentOrigin` instead of ``on_oom``.
        ``oom_posts`` limits each poster's OOM incidents (default: a fresh
        :class:`PosterRateLimit`)."""
        policy = policy or PortPolicy()
        self.oom_posts = oom_posts or PosterRateLimit()
        handler = _handler_class(
            render_metrics=render_metrics,
            state=state,
            torch_reports=torch_reports,
            stale_after=poll_interval_seconds * STALE_POLL_INTERVALS,
            on_oom=_forwarder(on_oom, on_oom_from),
            history=history,
            clock=clock,
            proc_root=policy.proc_root,
            spool_problem=spool_problem,
        )
        guard = RequestGuard.for_listener(
            address[0], policy.allowed_hosts, setting="[agent] allowed_hosts"
        )
        self._server = BoundedHTTPServer(
            address, _guarded(handler, policy, guard, self.oom_posts), policy=policy
        )
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
    proc_root: Path = Path("/proc"),
    spool_problem: Callable[[], str | None] | None = None,
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
            if not is_loopback_address(self.client_address[0]):
                self._error(403, "only local processes may post to the agent")
                return None
            length_header = self.headers.get("Content-Length")
            if length_header is None or not length_header.isdigit():
                # The body (chunked, or of no stated length) stays unread: the
                # connection must not carry it into the next request.
                self.close_connection = True
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
                self.close_connection = True  # a client that sends this is not ours
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
                elif (problem := spool_problem() if spool_problem else None) is not None:
                    body = f"degraded: {problem}\n".encode()
                    self._send(200, body, "text/plain; charset=utf-8")
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
                origin: IncidentOrigin | None = getattr(_request, "origin", None)
                refused = torch_report_refusal(report.pid, origin, proc_root)
                if refused is not None:
                    log.info("allocator report refused: %s", refused)
                    self._error(403, refused)
                    return
                torch_reports.record(report, poster_uid=origin.peer_uid if origin else None)
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


def torch_report_refusal(pid: int, origin: IncidentOrigin | None, proc_root: Path) -> str | None:
    """Why an allocator report about ``pid`` from ``origin`` is refused (``None``: taken).

    The figures are shown as ``pid``'s own (its owner's, in the snapshot and the
    metrics), so only that process's owner or root may send them: the poster's uid is
    the kernel's (``/proc/net/tcp``), the owner's ``/proc/<pid>/status``. A report
    about a PID that runs nothing is taken: it can attach to no process, not even to
    one that takes the PID later (:mod:`gpuwatch.agent.torch_reports` dates it no later
    than its arrival, before that process started)."""
    if origin is None or origin.peer_uid is None:
        return "the agent cannot tell which local user sent this report"
    owner = process_uid(pid, proc_root=proc_root)
    if owner is not None and not origin.speaks_for(owner):
        return (
            f"pid {pid} belongs to uid {owner}, and the poster (uid {origin.peer_uid}) is "
            "neither its owner nor root"
        )
    return None


def _first_error(err: ValidationError) -> str:
    first = err.errors()[0]
    where = ".".join(str(p) for p in first["loc"]) or "body"
    return f"{where}: {first['msg']}"


_INDEX = b"""<!doctype html><title>gpuwatch agent</title>
<h1>gpuwatch agent</h1>
<ul><li><a href="/metrics">/metrics</a></li><li><a href="/snapshot">/snapshot</a></li>
<li><a href="/healthz">/healthz</a></li></ul>
"""


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
    handler: type[BaseHTTPRequestHandler],
    policy: PortPolicy,
    guard: RequestGuard,
    oom_posts: PosterRateLimit,
) -> type[BaseHTTPRequestHandler]:
    """``handler`` with the access rules applied before any route runs (the routes
    themselves are unchanged)."""

    class Guarded(handler):  # type: ignore[valid-type,misc]
        def parse_request(self) -> bool:
            _request.origin = None  # never a previous request's, on this worker thread
            if not super().parse_request():
                return False
            path = self.path.split("?", 1)[0]
            # A browser's request under a foreign Host (DNS rebinding) or from another
            # site (a cross-site POST) is refused before anything reads its body: the
            # connection closes, so an unread body is never taken for the next request.
            refused = guard.refusal(
                self.command,
                self.headers.get("Host"),
                self.headers.get("Origin"),
                self.headers.get("Sec-Fetch-Site"),
            )
            if refused is not None:
                log.warning("%s %s refused %d: %s", self.command, path, *refused)
                self.close_connection = True
                self._error(*refused)
                return False
            # /reaper/history names every process's PIDs, GPUs and activity: the same
            # rule as the snapshot.
            if self.command in ("GET", "HEAD") and path in _PRIVATE_PATHS:
                if not self._may_read_snapshot():
                    self._error(403, _SNAPSHOT_REFUSED[policy.snapshot_access])
                    return False
            elif self.command == "POST" and path == INCIDENTS_OOM_PATH:
                if not policy.accept_oom_incidents:
                    self.close_connection = True
                    self._error(
                        403, "this agent does not accept OOM incidents (accept_oom_incidents)"
                    )
                    return False
                # A browser can send text/plain (or a form) to another origin without
                # asking first; application/json it must ask about (a CORS preflight,
                # which this port does not answer). gpuwatch.torch sends JSON.
                if not is_json_media_type(self.headers.get("Content-Type")):
                    self.close_connection = True
                    self._error(415, "an OOM incident must be sent as application/json")
                    return False
                _request.origin = origin = self._origin()
                wait = oom_posts.take(origin.peer_uid)
                if wait is not None:
                    self._too_many(origin, wait)
                    return False
            elif self.command == "POST" and path == TORCH_PATH:
                # A report speaks for its process: only its owner or root may send one.
                _request.origin = self._origin()
            return True

        def _too_many(self, origin: IncidentOrigin, wait: float) -> None:
            """429 before the body is read; the connection closes, its body unread."""
            if oom_posts.refused_total == 1 or oom_posts.refused_total % 100 == 0:
                log.warning(
                    "OOM incidents from uid %s (%s) come faster than the agent forwards "
                    "them: refused with 429 (%d refused since the agent started)",
                    origin.peer_uid,
                    origin.peer_user,
                    oom_posts.refused_total,
                )
            self.close_connection = True
            body = json.dumps({"error": "too many OOM incidents from this user"}).encode()
            self._send(
                429,
                body + b"\n",
                "application/json",
                {"Retry-After": str(max(1, math.ceil(wait))), "Connection": "close"},
            )

        def _may_read_snapshot(self) -> bool:
            if policy.snapshot_access == "open" or is_loopback_address(self.client_address[0]):
                return True
            if policy.snapshot_access != "token" or not policy.snapshot_token:
                return False
            given = self.headers.get("Authorization", "")
            expected = f"Bearer {policy.snapshot_token}"
            return hmac.compare_digest(given.encode(), expected.encode())

        def _origin(self) -> IncidentOrigin:
            client = (str(self.client_address[0]), int(self.client_address[1]))
            local = self.connection.getsockname()
            return IncidentOrigin.of_peer(client, (local[0], local[1]), proc_root=policy.proc_root)

        def _error(self, status: int, message: str) -> None:  # routes define it too
            super()._error(status, message)  # type: ignore[misc]

        def _send(
            self, status: int, body: bytes, content_type: str, headers: dict[str, str] | None = None
        ) -> None:  # routes define it too
            super()._send(status, body, content_type, headers)  # type: ignore[misc]

    Guarded.__name__ = Guarded.__qualname__ = handler.__name__
    return Guarded


_SNAPSHOT_REFUSED = {
    "loopback": "/snapshot holds every user's command lines: only this host may read it "
    "(snapshot_access)",
    "token": "/snapshot needs Authorization: Bearer <snapshot_token> from other hosts",
    "open": "",
}
