"""Prometheus Alertmanager: push the alerts to its ``POST /api/v2/alerts``.

Each alert becomes::

    {"labels": {"alertname": <rule>, ...labels},
     "annotations": {"summary": ..., "description": ..., "culprits": "<short text>"},
     "startsAt": <RFC 3339>, "endsAt": <RFC 3339, resolved alerts only>,
     "generatorURL": <external_url, when configured>}

The engine sends a receiver's due notifications together (:meth:`AlertmanagerReceiver.attempt_batch`),
in POSTs of a few hundred alerts, as Prometheus does: one POST per group would not keep
up with a thousand firing groups re-pushed every minute.

A firing alert carries no ``endsAt``: Alertmanager then holds it for its
``resolve_timeout`` (5m by default) and, like Prometheus, expects it to be pushed
again before that runs out. A resolved alert carries its ``endsAt``, which ends it.

The receiver's ``url`` is Alertmanager's base URL (with ``--web.route-prefix`` if one is
set); credentials in it (``https://user:pass@am.example/``) are sent as basic auth.

An ``endsAt`` before ``startsAt`` (a clock stepped back between the two) is sent as
``startsAt``: Alertmanager refuses such an alert with a 400.

Outcomes: 2xx sent; 408, 425, 429, 5xx, timeout, connection error retry; 3xx and other
4xx (400: Alertmanager refused the alerts) broken. Alertmanager answers 400 to a whole
POST when one of its alerts is invalid (storing the others), so the engine splits a
refused batch and resends the halves until only the refused notifications are left.
"""

from __future__ import annotations

import json
import re
import time
from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx

from gpuwatch.server.notifications.config import ReceiverConfig
from gpuwatch.server.notifications.model import Attempt, Notification, NotifiedAlert
from gpuwatch.server.notifications.receivers.base import Clock, HttpReceiver, sendable_alerts
from gpuwatch.server.notifications.receivers.text import culprits_text
from gpuwatch.terminal_text import printable

API_PATH = "/api/v2/alerts"
_LABEL_NAME = re.compile(r"[^A-Za-z0-9_]")


def rfc3339(epoch: float) -> str:
    """``2026-08-22T10:00:00.123Z`` (UTC, milliseconds), as Alertmanager's API parses it."""
    return (
        datetime.fromtimestamp(epoch, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    )


def _label_name(name: str) -> str:
    # Alertmanager 0.25 accepts only Prometheus label names.
    name = _LABEL_NAME.sub("_", name)
    return "_" + name if name[:1].isdigit() else name


def payload(
    notification: Notification, alerts: list[NotifiedAlert] | None = None
) -> list[dict[str, Any]]:
    """The ``postableAlerts`` list for ``POST /api/v2/alerts``."""
    alerts = list(notification.alerts) if alerts is None else alerts
    out = []
    for alert in alerts:
        # An empty label value is no label in Prometheus' model.
        # Label values from agents (a user name) one line each, as the summary is:
        # Alertmanager's own templates put them in chat messages.
        labels = {_label_name(k): printable(v) for k, v in alert.labels.items() if v}
        labels["alertname"] = alert.rule
        annotations = {
            "summary": alert.summary,
            "description": alert.description,
            "culprits": culprits_text(alert.culprits),
        }
        item: dict[str, Any] = {
            "labels": labels,
            "annotations": {k: v for k, v in annotations.items() if v},
            "startsAt": rfc3339(alert.starts_at),
        }
        if alert.ends_at is not None:
            # Alertmanager refuses (400) an alert that ends before it starts, which a
            # clock stepped back between the two can make: it ends as it starts then.
            item["endsAt"] = rfc3339(max(alert.ends_at, alert.starts_at))
        if notification.external_url:
            item["generatorURL"] = notification.external_url
        out.append(item)
    return out


def api_url(base: str) -> str:
    """The alerts endpoint under Alertmanager's base URL (keeping a route prefix)."""
    parts = urlsplit(base)
    return urlunsplit(parts._replace(path=parts.path.rstrip("/") + API_PATH))


class AlertmanagerReceiver(HttpReceiver):
    type = "alertmanager"

    def __init__(
        self, config: ReceiverConfig, *, client: httpx.Client, clock: Clock = time.time
    ) -> None:
        super().__init__(config, client=client, clock=clock)
        self._url = api_url(config.url.get_secret_value())

    def request(
        self, notification: Notification, alerts: list[NotifiedAlert]
    ) -> tuple[str, bytes, dict[str, str]]:
        body = json.dumps(payload(notification, alerts), ensure_ascii=False).encode()
        return self._url, body, {}

    def attempt_batch(self, notifications: list[Notification]) -> Attempt:
        """One POST of the alerts of several notifications (``/api/v2/alerts`` takes a
        list, as Prometheus sends it). An alert in more than one (an older notification
        of its group) is sent once, as the last of them has it."""
        items: dict[str, dict[str, Any]] = {}
        for notification in notifications:
            alerts = sendable_alerts(notification, send_resolved=self.send_resolved)
            for alert, item in zip(alerts, payload(notification, alerts), strict=True):
                items.pop(alert.fingerprint, None)
                items[alert.fingerprint] = item
        if not items:
            return self.nothing_to_send()
        body = json.dumps(list(items.values()), ensure_ascii=False).encode()
        return self.send(self._url, body, {})
