"""The life cycle of an alert, as Prometheus defines it, over one evaluation.

* A condition that starts holding makes the alert ``pending`` (``active_since``).
* Pending for at least the rule's ``for``: ``firing`` (``fired_at``: its start).
* A pending alert whose condition stops holding is dropped: it never fired, so
  nobody hears of it.
* A firing alert whose condition stops holding stays firing for ``keep_firing_for``
  after it last held (``last_true_at``), then is ``resolved`` (``resolved_at``). A
  resolved alert is final: if its condition returns, a new alert starts, pending.
* Missing data is not news that a condition ended. An alert whose host is silent, or
  whose GPU is lost or unreadable (``sees`` says no), stays as it is (pending, or
  firing with its last content) for as long as that lasts (``agent_silent`` or
  ``gpu_lost`` says why); once the host or GPU is seen again, it holds or ends on what
  is seen. A retired host is seen as gone: its alerts end. Exempt: the rules about the
  missing data itself, and announcements (they end with their announcement window).

Pure: states and candidates in, the states that changed out. Times are epoch seconds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from gpuwatch.server.alerts.config import ANNOUNCEMENTS, AlertSettings
from gpuwatch.server.alerts.rules import Candidate, resolved_summary
from gpuwatch.server.notifications.model import Culprit

# Rules whose condition is that a host or GPU cannot be seen, and announcements, which
# end with their window: they are never held for want of data.
_ABOUT_UNSEEN = frozenset({"agent_silent", "gpu_lost", *ANNOUNCEMENTS})


@dataclass(frozen=True)
class AlertState:
    """An alert as stored (``id`` None until written). ``state`` is ``pending``,
    ``firing`` or ``resolved``; ``dropped`` marks a pending alert to delete."""

    fingerprint: str
    rule: str
    labels: dict[str, str]
    severity: str
    state: str
    summary: str
    description: str
    culprits: list[Culprit]
    active_since: float
    last_true_at: float
    fired_at: float | None = None
    resolved_at: float | None = None
    id: int | None = None
    dropped: bool = field(default=False, compare=False)

    def culprits_json(self) -> list[dict[str, Any]]:
        return [vars(c) for c in self.culprits]


def advance(
    active: dict[str, AlertState],
    candidates: list[Candidate],
    settings: AlertSettings,
    *,
    now: float,
    sees: Callable[[dict[str, str]], bool] = lambda labels: True,
) -> list[AlertState]:
    """Move every active (pending or firing) alert and every candidate one evaluation
    forward; return the alerts that changed (new, updated, fired, resolved, dropped).
    ``sees(labels)``: whether the host and GPU an alert names can be seen now
    (:meth:`~gpuwatch.server.alerts.facts.Facts.sees`)."""
    changed: list[AlertState] = []
    holding = {c.fingerprint: c for c in candidates}
    for fp, candidate in holding.items():
        current = active.get(fp)
        if current is None:
            current = AlertState(
                fingerprint=fp,
                rule=candidate.rule,
                labels=candidate.labels,
                severity=candidate.severity,
                state="pending",
                summary=candidate.summary,
                description=candidate.description,
                culprits=candidate.culprits,
                active_since=now,
                last_true_at=now,
            )
        else:
            current = replace(
                current,
                summary=candidate.summary,
                description=candidate.description,
                culprits=candidate.culprits,
                last_true_at=now,
            )
        rule = getattr(settings.rules, candidate.rule)
        if current.state == "pending" and now - current.active_since >= rule.for_seconds:
            current = replace(current, state="firing", fired_at=now)
        changed.append(current)
    for fp, current in active.items():
        if fp in holding:
            continue
        if current.rule not in _ABOUT_UNSEEN and not sees(current.labels):
            continue  # held, pending or firing: nothing says its condition ended
        if current.state == "pending":
            changed.append(replace(current, dropped=True))
            continue
        rule = getattr(settings.rules, current.rule, None)
        keep = 0.0 if rule is None else rule.keep_firing_for_seconds
        if now - current.last_true_at >= keep:
            changed.append(
                replace(
                    current,
                    state="resolved",
                    resolved_at=now,
                    summary=resolved_summary(current.summary),
                )
            )
    return changed
