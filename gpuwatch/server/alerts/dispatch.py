"""Which notifications are due now: routing, silences, grouping and Alertmanager's timers.

Per receiver, the alerts routed to it and not silenced are grouped by the values of
``group_by``. A group waits ``group_wait`` after its first alert before its first
notification, then is looked at every ``group_interval``. At each look it notifies
when an alert started firing since the last notification, or one that was notified
firing has resolved (sent only to receivers with ``send_resolved``); otherwise it
repeats the firing alerts once ``repeat_interval`` has passed since the last
notification. An alert that resolves before its group's first look was never
notified, so its resolution is not either. Alertmanager receivers have no timers but a
re-push every :data:`ALERTMANAGER_RESEND_SECONDS`: a new firing alert or a resolution
is pushed at the evaluation that decided it. A silenced alert that was notified firing
stays "told firing" while it is muted, so a resolution within the silence is sent
once the silence ends (Alertmanager drops it: prometheus/alertmanager#226).

Pure: alerts, group states and silences in; notifications and new group states out.
Times are epoch seconds.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field, replace
from typing import Any

from gpuwatch.server.alerts import regex
from gpuwatch.server.alerts.config import ANNOUNCEMENTS, AlertSettings, Route
from gpuwatch.server.alerts.lifecycle import AlertState
from gpuwatch.server.notifications.model import Notification, NotifiedAlert


@dataclass(frozen=True)
class Matcher:
    """``name=value`` (exact) or ``name=~regex`` (whole value); a missing label is ""."""

    name: str
    value: str
    regex: bool = False

    def matches(self, labels: dict[str, str]) -> bool:
        actual = labels.get(self.name, "")
        if self.regex:
            # Checked and compiled once; a stored pattern that could stall the server
            # (created before patterns were checked) matches nothing, so mutes nothing.
            pattern = regex.compiled(self.value)
            return pattern is not None and pattern.fullmatch(actual) is not None
        return actual == self.value


@dataclass(frozen=True)
class Silence:
    id: int
    matchers: tuple[Matcher, ...]
    starts_at: float
    ends_at: float

    def mutes(self, labels: dict[str, str], now: float) -> bool:
        return self.starts_at <= now < self.ends_at and all(
            m.matches(labels) for m in self.matchers
        )


@dataclass(frozen=True)
class GroupState:
    """What the notification log remembers of one group (``alert_groups``)."""

    receiver: str
    group_key: str
    group_labels: dict[str, str]
    first_alert_at: float | None = None
    flushed_at: float | None = None
    notified_at: float | None = None
    notified_firing: tuple[str, ...] = ()
    id: int | None = None
    # What the receiver was actually told fires (a delivered notification said so),
    # which the engine records as notifications are sent: a notification given up at
    # its deadline makes ``notified_firing`` fall back to it, so a resolution owed is
    # planned again at the next look.
    delivered_firing: tuple[str, ...] = ()


# Alertmanager resolves an alert it has not heard of for its resolve_timeout (5 min by
# default), and does its own grouping: like Prometheus, gpuwatch re-sends every firing
# alert to it this often, with no group_wait.
ALERTMANAGER_RESEND_SECONDS = 60.0


@dataclass(frozen=True)
class ReceiverInfo:
    name: str
    send_resolved: bool = True
    # Alertmanager receivers: re-send firing alerts this often, whatever the timers.
    resend_seconds: float | None = None


@dataclass
class Plan:
    """What one dispatch decided: notifications to send and group states to store."""

    notifications: list[tuple[Notification, float]] = field(default_factory=list)
    groups: list[GroupState] = field(default_factory=list)


def routed(alert: AlertState, routes: list[Route], receiver: str) -> bool:
    """Does ``alert`` go to ``receiver``? Without routes every alert goes everywhere."""
    if not routes:
        return True
    return any(
        route.receiver == receiver
        and (not route.rules or alert.rule in route.rules)
        and all(alert.labels.get(k) == v for k, v in route.match.items())
        for route in routes
    )


# The longest group key: the width of the ``group_key`` columns.
GROUP_KEY_MAX = 512


def group_of(labels: dict[str, str], group_by: list[str]) -> tuple[str, dict[str, str]]:
    """A group's key (``{rule='gpu_lost',hostname='h1'}``) and its label values. A key
    longer than :data:`GROUP_KEY_MAX` is cut, and ends with the SHA-256 of the whole
    key instead: still readable, still distinct, and stored and looked up alike."""
    values = {name: labels.get(name, "") for name in group_by}
    return bounded_key("{" + ",".join(f"{k}={v!r}" for k, v in values.items()) + "}"), values


def bounded_key(key: str) -> str:
    """``key`` if it fits :data:`GROUP_KEY_MAX`, else its head and ``...sha256:<hex>``
    of the whole key, :data:`GROUP_KEY_MAX` characters in all."""
    if len(key) <= GROUP_KEY_MAX:
        return key
    suffix = "...sha256:" + hashlib.sha256(key.encode()).hexdigest()
    return key[: GROUP_KEY_MAX - len(suffix)] + suffix


def plan(
    alerts: Iterable[AlertState],
    groups: dict[tuple[str, str], GroupState],
    silences: list[Silence],
    receivers: list[ReceiverInfo],
    settings: AlertSettings,
    *,
    now: float,
) -> Plan:
    """Decide every group's notification at ``now``."""
    result = Plan()
    audible: list[AlertState] = []
    muted: list[AlertState] = []
    for a in alerts:
        if a.state in ("firing", "resolved"):
            quiet = any(s.mutes(a.labels, now) for s in silences)
            (muted if quiet else audible).append(a)
    for receiver in receivers:
        members: dict[str, list[AlertState]] = {}
        labels_of: dict[str, dict[str, str]] = {}
        for alert in audible:
            if routed(alert, settings.routes, receiver.name):
                key, values = group_of(alert.labels, settings.group_by)
                members.setdefault(key, []).append(alert)
                labels_of[key] = values
        silenced: dict[str, set[str]] = {}
        for alert in muted:
            if routed(alert, settings.routes, receiver.name):
                key, _ = group_of(alert.labels, settings.group_by)
                silenced.setdefault(key, set()).add(alert.fingerprint)
        keys = set(members) | {k for (r, k) in groups if r == receiver.name}
        for key in sorted(keys):
            state = groups.get((receiver.name, key)) or GroupState(
                receiver.name, key, labels_of.get(key, {})
            )
            new_state, notification = _look(
                state,
                members.get(key, []),
                receiver,
                settings,
                now=now,
                silenced=silenced.get(key, set()),
            )
            if new_state != state:
                result.groups.append(new_state)
            if notification is not None:
                result.notifications.append((notification, now))
    return result


def _look(
    state: GroupState,
    members: list[AlertState],
    receiver: ReceiverInfo,
    settings: AlertSettings,
    *,
    now: float,
    silenced: AbstractSet[str] = frozenset(),
) -> tuple[GroupState, Notification | None]:
    """One look at a group: its new state, and the notification due (or None).

    ``members`` are the group's audible alerts; ``silenced`` the fingerprints of its
    alerts muted now. A muted alert the receiver was told fires stays in
    ``notified_firing`` (held) for as long as it is muted, whether it still fires or
    has resolved meanwhile: the receiver still believes it fires. So once the silence
    ends, its resolution is sent like any other, and one still firing is not announced
    again as new (it repeats after ``repeat_interval``). Alertmanager forgets it
    (prometheus/alertmanager#226): a page that fired before a silence, and resolved
    within it, stayed open in the receiver for good."""
    firing = {a.fingerprint: a for a in members if a.state == "firing"}
    notified = set(state.notified_firing)
    held = notified & silenced
    # The delivered record keeps only alerts still here to be resolved (a receiver
    # without send_resolved is owed no resolution), so it pins no alert row for good.
    here = set(firing) | set(silenced)
    if receiver.send_resolved:
        here |= {a.fingerprint for a in members if a.rule not in ANNOUNCEMENTS}
    delivered = tuple(sorted(set(state.delivered_firing) & here))
    if delivered != state.delivered_firing:
        state = replace(state, delivered_firing=delivered)
    resolved = {
        a.fingerprint: a
        for a in members
        if a.state == "resolved"
        and a.fingerprint in notified
        and a.fingerprint not in firing
        and a.rule not in ANNOUNCEMENTS  # an announcement ends unannounced
    }
    if not firing and not resolved:
        # Nothing audible: forget the timers, so the next alert waits group_wait again.
        return (
            replace(
                state, first_alert_at=None, flushed_at=None, notified_firing=tuple(sorted(held))
            ),
            None,
        )
    if state.first_alert_at is None:
        state = replace(state, first_alert_at=now)
    assert state.first_alert_at is not None
    wait, interval, repeat_after = (
        (
            settings.group_wait_seconds,
            settings.group_interval_seconds,
            settings.repeat_interval_seconds,
        )
        if receiver.resend_seconds is None
        else (0.0, receiver.resend_seconds, receiver.resend_seconds)
    )
    # The first look waits group_wait from the group's first alert; later ones follow
    # the previous look by group_interval.
    last_look = state.flushed_at
    due = state.first_alert_at + wait if last_look is None else last_look + interval
    new_firing = bool(set(firing) - notified)
    if receiver.resend_seconds is not None and (
        new_firing or (resolved and receiver.send_resolved)
    ):
        # Alertmanager hears of a change at the evaluation that decided it, as
        # Prometheus sends it: riding on the next re-push, a resolution reached it up
        # to a minute after the other receivers, and it showed the alert active meanwhile.
        due = now
    if now < due:
        return state, None
    state = replace(state, flushed_at=now)
    # No notified_at with alerts firing: the last notification was given up at its
    # deadline (the engine's retell), so what still fires is told again now.
    repeat = bool(firing) and (state.notified_at is None or now - state.notified_at >= repeat_after)
    send_resolved = bool(resolved) and receiver.send_resolved
    still = tuple(sorted(set(firing) | held))
    if not (new_firing or send_resolved or repeat):
        # Resolved alerts a receiver does not want are logged as told all the same.
        return replace(state, notified_firing=still), None
    shown = list(firing.values()) + (list(resolved.values()) if receiver.send_resolved else [])
    notification = Notification(
        receiver=receiver.name,
        group_key=state.group_key,
        group_labels=state.group_labels,
        status="firing" if firing else "resolved",
        alerts=[_notified(a) for a in sorted(shown, key=_order)],
        external_url=settings.external_url,
    )
    return replace(state, notified_at=now, notified_firing=still), notification


def _order(alert: AlertState) -> tuple[int, str, float]:
    severity = {"critical": 0, "warning": 1, "info": 2}.get(alert.severity, 3)
    return (severity, alert.rule, alert.fired_at or alert.active_since)


def _notified(alert: AlertState) -> NotifiedAlert:
    return NotifiedAlert(
        rule=alert.rule,
        status="firing" if alert.state == "firing" else "resolved",
        labels=alert.labels,
        summary=alert.summary,
        description=alert.description,
        starts_at=alert.fired_at if alert.fired_at is not None else alert.active_since,
        ends_at=alert.resolved_at,
        fingerprint=alert.fingerprint,
        culprits=list(alert.culprits),
    )


def matchers_from_json(raw: list[dict[str, Any]]) -> tuple[Matcher, ...]:
    return tuple(Matcher(m["name"], m["value"], bool(m.get("regex", False))) for m in raw)
