"""``reaped`` events for the central server: what was (or would be) stopped, by whom.

Inside the agent the events go through its sink (``SnapshotSink.send_event``: one
sender thread, ``reaped`` events first and retried until the server stores them,
:mod:`gpuwatch.agent.push`); the sink answers each with an :class:`EventDelivery`, which
the policy reads to know whether a warning reached the server. ``gpuwatch reap`` on the command line POSTs them
itself with the agent's token, when the agent settings name a server and a token;
a failure is reported and never stops the reaper: the audit log is the record.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gpuwatch.agent.reaper.policy import Decision
from gpuwatch.wire import EVENTS_PATH, MAX_EVENT_SUMMARY_CHARS, ReportedEvent

if TYPE_CHECKING:
    import httpx

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Actor:
    """Who acted: ``via`` is ``"gpuwatch reap"`` or ``"agent policy"``; ``sudo_user``
    the person behind ``sudo`` when there is one."""

    uid: int
    user: str
    pid: int
    via: str
    sudo_user: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "uid": self.uid,
            "user": self.user,
            "pid": self.pid,
            "via": self.via,
            "sudo_user": self.sudo_user,
        }

    @property
    def who(self) -> str:
        return f"{self.sudo_user} via sudo" if self.sudo_user else self.user


def describe(decision: Decision) -> str:
    """``pid 4242 (alice, jupyter kernel, 11.0 GiB on gpu1)``."""
    c = decision.candidate
    what = "jupyter kernel" if c.jupyter_kernel else (c.name or "?")
    gpus = ",".join(f"gpu{i}" for i in c.gpus)
    return f"pid {c.pid} ({c.user or c.uid}, {what}, {c.memory_bytes / 2**30:.1f} GiB on {gpus})"


def reaped_event(
    decision: Decision,
    *,
    hostname: str,
    actor: Actor,
    stage: str,
    summary: str,
    occurred_at: float,
    extra: dict[str, Any] | None = None,
) -> ReportedEvent:
    """The :class:`~gpuwatch.wire.ReportedEvent` (kind ``reaped``) for one decision.

    ``stage`` says what happened: ``stopped``, ``dry_run``, ``refused``, ``failed``,
    ``warning`` or ``withdrawn`` (the policy's), and is in ``evidence``.
    """
    c = decision.candidate
    evidence: dict[str, Any] = {
        "stage": stage,
        "actor": actor.as_dict(),
        "verdict": decision.verdict,
        "reason": decision.reason,
        "detail": decision.detail,
        "command": c.command,
        "start_time": c.start_time,
        "gpus": c.gpus,
        "idle_seconds": decision.idle_seconds,
        "coverage_ratio": decision.coverage_ratio,
        **(extra or {}),
    }
    return ReportedEvent(
        kind="reaped",
        hostname=hostname,
        gpu_index=c.largest.gpu_index,
        pid=c.pid,
        user=c.user,
        held_bytes=c.memory_bytes,
        summary=summary[:MAX_EVENT_SUMMARY_CHARS],
        evidence=evidence,
        occurred_at=occurred_at,
    )


class EventPoster:
    """POSTs events to ``{server_url}/api/v1/events`` with the agent's bearer token.

    Synchronous, one attempt and one retry; returns whether the server stored it.
    ``transport`` is for tests (``httpx.MockTransport``).
    """

    def __init__(
        self,
        server_url: str,
        token: str | None,
        *,
        timeout: float = 5.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self._url = server_url.rstrip("/") + EVENTS_PATH
        self._headers = {"Content-Type": "application/json"}
        if token:
            self._headers["Authorization"] = f"Bearer {token}"
        self._timeout = timeout
        self._transport = transport
        self.failures: list[str] = []

    def send_event(self, event: ReportedEvent) -> bool:
        import httpx  # here, not at the top: the agent process does without httpx

        body = event.model_dump_json().encode()
        problem = ""
        with httpx.Client(timeout=self._timeout, transport=self._transport) as client:
            for _ in range(2):
                try:
                    response = client.post(self._url, content=body, headers=self._headers)
                except httpx.HTTPError as err:
                    problem = f"unreachable ({type(err).__name__})"
                    continue
                if response.is_success:
                    return True
                problem = f"HTTP {response.status_code}"
                if response.status_code < 500:
                    break
        log.warning("the server did not record the reaped event for pid %s: %s", event.pid, problem)
        self.failures.append(f"pid {event.pid}: {problem}")
        return False
