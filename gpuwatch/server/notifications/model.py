"""What the alert engine hands a receiver: a notification for one group of alerts.

A notification is built once, stored as JSON in the notification log (``to_json``),
and sent from there, so a retry after a restart sends exactly what the first attempt
did. Times are Unix epoch seconds; sizes are bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Literal

Status = Literal["firing", "resolved"]


@dataclass(frozen=True)
class Culprit:
    """A process the alert blames: whose it is and how much it holds (and grows)."""

    pid: int
    user: str | None
    command: str | None
    memory_bytes: int | None
    container_id: str | None = None
    pod_uid: str | None = None
    slurm_job_id: str | None = None
    # Growth rate, for filling-up alerts (None where the rule has no trend).
    slope_bytes_per_second: float | None = None


@dataclass(frozen=True)
class NotifiedAlert:
    """One alert as a receiver sees it.

    ``rule`` is the rule's name (``gpu_filling_up``); ``labels`` always has ``rule``
    and ``severity``, and ``hostname``, ``gpu``, ``user``, ``team`` where they apply.
    ``ends_at`` is None while the alert fires. ``fingerprint`` identifies the alert
    across notifications (a hash of rule and labels).
    """

    rule: str
    status: Status
    labels: dict[str, str]
    summary: str
    description: str
    starts_at: float
    ends_at: float | None
    fingerprint: str
    culprits: list[Culprit] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        """What ``dataclasses.asdict`` makes of it, written out (see
        :meth:`Notification.to_json`); the webhook's body carries the same."""
        return {
            "rule": self.rule,
            "status": self.status,
            "labels": dict(self.labels),
            "summary": self.summary,
            "description": self.description,
            "starts_at": self.starts_at,
            "ends_at": self.ends_at,
            "fingerprint": self.fingerprint,
            "culprits": [
                {name: getattr(c, name) for name in _CULPRIT_FIELDS} for c in self.culprits
            ],
        }


@dataclass(frozen=True)
class Notification:
    """The alerts of one group, for one receiver, at one flush.

    ``status`` is ``firing`` when any alert in it fires, else ``resolved``.
    ``group_key`` identifies the group (receiver and grouping label values);
    ``group_labels`` are those label values.
    """

    receiver: str
    group_key: str
    group_labels: dict[str, str]
    status: Status
    alerts: list[NotifiedAlert]
    # Where a person can see more (the server's external URL), if configured.
    external_url: str | None = None

    def to_json(self) -> dict[str, Any]:
        """What ``dataclasses.asdict`` makes of it, written out: asdict's generic deep
        copy was most of the cost of planning 20,000 notifications."""
        return {
            "receiver": self.receiver,
            "group_key": self.group_key,
            "group_labels": dict(self.group_labels),
            "status": self.status,
            "alerts": [a.to_json() for a in self.alerts],
            "external_url": self.external_url,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Notification:
        alerts = [
            NotifiedAlert(**{**a, "culprits": [Culprit(**c) for c in a.get("culprits", [])]})
            for a in data["alerts"]
        ]
        return cls(**{**data, "alerts": alerts})


_CULPRIT_FIELDS = tuple(f.name for f in fields(Culprit))

Outcome = Literal["sent", "retry", "broken"]


@dataclass(frozen=True)
class Attempt:
    """What one delivery attempt came to.

    ``sent``: the receiver took it. ``retry``: a transient failure (5xx, timeout,
    connection error, 429); try again, not before ``retry_after`` seconds when the
    receiver said so (``Retry-After``). ``broken``: a permanent failure (400, 403,
    404, 410: a revoked or misconfigured webhook); the receiver is marked broken and
    the notification is not retried. ``detail`` is one line for people: it never
    contains the receiver's URL or secret (they are credentials).
    """

    outcome: Outcome
    detail: str
    retry_after: float | None = None
    status_code: int | None = None
