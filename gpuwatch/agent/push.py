"""The agent's link to the central server: snapshots through the spool, events direct.

Snapshots go through :class:`~gpuwatch.agent.reporter.Reporter` and its on-disk spool,
with its "stored exactly once or counted as dropped" promise. Events the agent relays
(OOM incidents from ``gpuwatch.torch``) are rarer and time-critical: each, a
:class:`~gpuwatch.wire.ReportedEvent`, is POSTed to ``/api/v1/events`` from a
background thread, tried up to :data:`EVENT_ATTEMPTS` times with backoff, and, if the
server stays away, logged locally with the incident's summary. That path promises *at
most once*, and says so in the log when it gives up.
"""

from __future__ import annotations

import logging
import threading
import time

from pydantic import ValidationError

from gpuwatch.agent.collectors.agent import PushStats
from gpuwatch.agent.http_post import Endpoint, Poster, Unreachable
from gpuwatch.agent.reporter import HTTP_TIMEOUT_SECONDS, Reporter
from gpuwatch.bearer import bearer_headers
from gpuwatch.settings import AgentSettings
from gpuwatch.snapshot import HostSnapshot
from gpuwatch.wire import EVENTS_PATH, ReportedEvent, ReportedEventResult

log = logging.getLogger(__name__)

EVENT_ATTEMPTS = 3
EVENT_BACKOFF_SECONDS = 2.0


class ServerSink:
    """Implements the agent's ``SnapshotSink`` on top of :class:`Reporter`."""

    def __init__(self, settings: AgentSettings) -> None:
        self.reporter = Reporter(settings)
        self._events_url = Endpoint.parse(settings.server_url, EVENTS_PATH).url
        token = settings.token.get_secret_value() if settings.token else None
        self._headers = {"Content-Type": "application/json"}
        # Stripped, and refused at startup (exit 3) if it cannot be a header value.
        self._headers.update(bearer_headers(token))

    def offer(self, snapshot: HostSnapshot) -> None:
        self.reporter.offer(snapshot)

    def push_stats(self) -> PushStats:
        return self.reporter.push_stats()

    def start(self) -> None:
        self.reporter.start()

    def stop(self) -> None:
        self.reporter.stop()

    def send_event(self, event: ReportedEvent) -> threading.Thread:
        """POST ``event`` in the background; returns the thread (tests join it)."""
        thread = threading.Thread(
            target=self._send, args=(event,), name="gpuwatch-event", daemon=True
        )
        thread.start()
        return thread

    def _send(self, event: ReportedEvent) -> None:
        body = event.model_dump_json().encode()
        client = Poster(timeout_seconds=HTTP_TIMEOUT_SECONDS)
        for attempt in range(1, EVENT_ATTEMPTS + 1):
            try:
                response = client.post(self._events_url, body, self._headers)
            except Unreachable as err:
                problem = f"unreachable ({err})"
            else:
                if response.is_success and _recorded(response.content):
                    return
                problem = f"HTTP {response.status}"
                if response.is_success:
                    # A proxy's page, a portal, another service: nothing was recorded,
                    # and asking again will get the same page.
                    problem += (
                        " that is not a gpuwatch answer (is server_url the server's base URL?)"
                    )
                    break
                if response.status in (400, 401, 403, 404, 413, 422):
                    break  # retrying will not change the answer
            if attempt < EVENT_ATTEMPTS:
                time.sleep(EVENT_BACKOFF_SECONDS * attempt)
        log.error(
            "could not record %s event for pid %s on the server (%s); it is only in this log: %s",
            event.kind,
            event.pid,
            problem,
            event.summary,
        )


def _recorded(content: bytes) -> bool:
    """Whether a 2xx body is the server's answer to an event (``ReportedEventResult``)."""
    try:
        ReportedEventResult.model_validate_json(content)
    except ValidationError:
        return False
    return True
