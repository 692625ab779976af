"""The agent's link to the central server: snapshots through the spool, events direct.

Snapshots go through :class:`~gpuwatch.agent.reporter.Reporter` and its on-disk spool,
with its "stored exactly once or counted as dropped" promise. Events the agent relays
(OOM incidents from ``gpuwatch.torch``, the reaper policy's ``reaped`` events) are each
a :class:`~gpuwatch.wire.ReportedEvent`, POSTed to ``/api/v1/events`` by one long-lived
sender thread (:class:`EventSender`), never a thread per event: any local user can post
OOM incidents, and a thread or a buffer per post would let them grow the agent without
bound.

- ``reaped`` events (warnings, withdrawals, stops) go first, and are retried until the
  server stores them or refuses them for good (400, 401, 403, 404, 413, 422): a warning
  that never reached anyone must not pass for given, and the policy holds a stop until
  its warning is delivered (:mod:`gpuwatch.agent.reaper.auto`). At most
  :data:`MAX_QUEUED_REAPED` wait; past that the oldest is dropped and counted.
- OOM incidents wait in a queue of :data:`MAX_QUEUED_OOMS`; past it the oldest is
  dropped and counted (``dropped``, and a log line per streak). Each is tried up to
  :data:`EVENT_ATTEMPTS` times, then logged locally with its summary and counted: *at
  most once*. Both counts are exported (``gpuwatch_agent_events_dropped``).
- A 429 or 503 is retried after its ``Retry-After`` (capped at
  :data:`MAX_RETRY_AFTER_SECONDS`), otherwise after a backoff.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace

from pydantic import ValidationError

from gpuwatch.agent.collectors.agent import PushStats
from gpuwatch.agent.event_delivery import EventDelivery
from gpuwatch.agent.http_post import Endpoint, Poster, Reply, Unreachable
from gpuwatch.agent.reporter import HTTP_TIMEOUT_SECONDS, Reporter
from gpuwatch.bearer import bearer_headers
from gpuwatch.settings import AgentSettings
from gpuwatch.snapshot import HostSnapshot
from gpuwatch.wire import EVENTS_PATH, ReportedEvent, ReportedEventResult

log = logging.getLogger(__name__)

EVENT_ATTEMPTS = 3  # for an OOM incident; a reaped event is retried until settled
EVENT_BACKOFF_SECONDS = 2.0
MAX_BACKOFF_SECONDS = 60.0
MAX_RETRY_AFTER_SECONDS = 300.0
# An OOM event is 30-60 KiB (the GPU's processes attached): 32 queued is 2 MiB at most.
MAX_QUEUED_OOMS = 32
# The policy's rate caps keep these few; the bound is for a server away for days.
MAX_QUEUED_REAPED = 256
# How long stop() waits for queued events at shutdown.
STOP_DRAIN_SECONDS = 5.0
_FINAL_STATUSES = frozenset({400, 401, 403, 404, 413, 422})

Post = Callable[[bytes], Reply]


@dataclass(frozen=True)
class _Queued:
    event: ReportedEvent
    delivery: EventDelivery


@dataclass(frozen=True)
class _Attempt:
    """One POST's outcome: stored, refused for good, or worth another try (after
    ``retry_after`` seconds when the server said so)."""

    stored: bool
    final: bool
    problem: str
    retry_after: float | None = None


class EventSender:
    """One daemon thread that POSTs queued events in turn (the section comment above).

    ``post`` sends one body and returns the reply (raises ``Unreachable``); ``wait``
    sleeps up to its argument and returns True when the sender is closing (default:
    the wait on :meth:`close`'s event), so a test runs retries without sleeping.
    """

    def __init__(self, post: Post, *, wait: Callable[[float], bool] | None = None) -> None:
        self._post = post
        self._closing = threading.Event()
        self._wait = wait if wait is not None else self._closing.wait
        self._cond = threading.Condition()
        self._reaped: deque[_Queued] = deque()
        self._ooms: deque[_Queued] = deque()
        self._thread: threading.Thread | None = None
        self._busy = False
        # (kind, reason) -> events never stored: queue_full (the oldest, past the
        # queue's bound), given_up (out of tries, or refused for good).
        self.dropped: dict[tuple[str, str], int] = {}

    def submit(self, event: ReportedEvent) -> EventDelivery:
        """Queue ``event``; the answer settles once the server stored it or it was given up."""
        item = _Queued(event, EventDelivery())
        with self._cond:
            if event.kind == "reaped":
                self._enqueue(self._reaped, item, MAX_QUEUED_REAPED)
            else:
                self._enqueue(self._ooms, item, MAX_QUEUED_OOMS)
            self._start()
            self._cond.notify()
        return item.delivery

    def _enqueue(self, queue: deque[_Queued], item: _Queued, bound: int) -> None:
        if len(queue) >= bound:
            oldest = queue.popleft()
            oldest.delivery.settle(delivered=False)
            dropped = self._count(oldest.event, "queue_full")
            if dropped == 1 or dropped % 100 == 0:  # one line per streak, not per post
                log.warning(
                    "%d %s event(s) waiting for the server: dropped the oldest "
                    "(%d dropped since the agent started)",
                    bound,
                    oldest.event.kind,
                    dropped,
                )
        queue.append(item)

    def _count(self, event: ReportedEvent, reason: str) -> int:
        key = (event.kind, reason)
        self.dropped[key] = self.dropped.get(key, 0) + 1
        return self.dropped[key]

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="gpuwatch-events", daemon=True)
            self._thread.start()

    def close(self, timeout_seconds: float = STOP_DRAIN_SECONDS) -> None:
        """Stop waiting between retries; wait up to ``timeout_seconds`` for the queue
        to be sent once more. Events given later are still sent (a stop the reaper
        finishes while the agent exits), each tried once."""
        self._closing.set()
        with self._cond:
            self._cond.notify()
            self._cond.wait_for(
                lambda: not (self._reaped or self._ooms or self._busy), timeout=timeout_seconds
            )

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._reaped or self._ooms))
                queue = self._reaped if self._reaped else self._ooms
                item = queue.popleft()
                self._busy = True
            try:
                item.delivery.settle(delivered=self._deliver(item.event))
            except Exception:  # the sender must outlive any one event
                log.exception(
                    "sending the %s event for pid %s failed", item.event.kind, item.event.pid
                )
                item.delivery.settle(delivered=False)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _deliver(self, event: ReportedEvent) -> bool:
        body = event.model_dump_json().encode()
        keep_trying = event.kind == "reaped"
        attempt = 0
        while True:
            attempt += 1
            outcome = self._attempt(body)
            if outcome.stored:
                return True
            out_of_tries = not keep_trying and attempt >= EVENT_ATTEMPTS
            if outcome.final or out_of_tries or self._closing.is_set():
                break
            delay = outcome.retry_after
            if delay is None:
                delay = min(EVENT_BACKOFF_SECONDS * attempt, MAX_BACKOFF_SECONDS)
            if self._wait(min(delay, MAX_RETRY_AFTER_SECONDS)):
                break  # closing: what is queued gets one try each
        self._count(event, "given_up")
        log.error(
            "could not record %s event for pid %s on the server (%s); it is only in this log: %s",
            event.kind,
            event.pid,
            outcome.problem,
            event.summary,
        )
        return False

    def _attempt(self, body: bytes) -> _Attempt:
        try:
            response = self._post(body)
        except Unreachable as err:
            return _Attempt(False, False, f"unreachable ({err})")
        if response.is_success:
            if _recorded(response.content):
                return _Attempt(True, False, "")
            # A proxy's page, a portal, another service: nothing was recorded, and
            # asking again will get the same page.
            return _Attempt(
                False,
                True,
                f"HTTP {response.status} that is not a gpuwatch answer "
                "(is server_url the server's base URL?)",
            )
        problem = f"HTTP {response.status}"
        if response.status in _FINAL_STATUSES:
            return _Attempt(False, True, problem)  # retrying will not change the answer
        return _Attempt(False, False, problem, _retry_after(response))


def _retry_after(response: Reply) -> float | None:
    """The answer's ``Retry-After`` in seconds (``None``: absent, or a date)."""
    value = (response.headers.get("Retry-After") or "").strip()
    return float(value) if value.isdigit() else None


class ServerSink:
    """Implements the agent's ``SnapshotSink`` on top of :class:`Reporter`."""

    def __init__(self, settings: AgentSettings) -> None:
        self.reporter = Reporter(settings)
        self._events_url = Endpoint.parse(settings.server_url, EVENTS_PATH).url
        token = settings.token.get_secret_value() if settings.token else None
        self._headers = {"Content-Type": "application/json"}
        # Stripped, and refused at startup (exit 3) if it cannot be a header value.
        self._headers.update(bearer_headers(token))
        self._poster = Poster(timeout_seconds=HTTP_TIMEOUT_SECONDS)
        self.events = EventSender(self._post_event)

    def offer(self, snapshot: HostSnapshot) -> None:
        self.reporter.offer(snapshot)

    def push_stats(self) -> PushStats:
        dropped = dict(self.events.dropped)  # a copy: the sender thread counts on
        return replace(self.reporter.push_stats(), events_dropped=dropped)

    def spool_problem(self) -> str | None:
        return self.reporter.spool_problem()

    def start(self) -> None:
        self.reporter.start()

    def stop(self) -> None:
        self.reporter.stop()
        self.events.close()

    def send_event(self, event: ReportedEvent) -> EventDelivery:
        """Queue ``event`` for the sender thread; its delivery settles once sent or given up."""
        return self.events.submit(event)

    def _post_event(self, body: bytes) -> Reply:
        return self._poster.post(self._events_url, body, self._headers)


def _recorded(content: bytes) -> bool:
    """Whether a 2xx body is the server's answer to an event (``ReportedEventResult``)."""
    try:
        ReportedEventResult.model_validate_json(content)
    except ValidationError:
        return False
    return True
