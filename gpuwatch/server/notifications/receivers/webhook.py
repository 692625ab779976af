"""Generic webhooks: a versioned JSON body, signed with HMAC-SHA256 of the raw bytes sent.

The body and the signature are specified in ``docs/alerts-webhook.md`` (version ``"1"``);
a change to either is a new version. The request carries::

    Content-Type: application/json
    X-Gpuwatch-Signature: sha256=<hex HMAC-SHA256 of the raw body, keyed with the secret>

Outcomes: 2xx sent; 408, 425, 429, 5xx, timeout, connection error retry (honouring
``Retry-After``); 3xx and other 4xx broken.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from typing import Any

from gpuwatch.server.notifications.model import Notification, NotifiedAlert
from gpuwatch.server.notifications.receivers.base import HttpReceiver

VERSION = "1"
SIGNATURE_HEADER = "X-Gpuwatch-Signature"


def sign(body: bytes, secret: str) -> str:
    """``sha256=<hex>``: HMAC-SHA256 of exactly ``body``, keyed with ``secret`` (UTF-8)."""
    return "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


def payload(
    notification: Notification, alerts: list[NotifiedAlert] | None = None
) -> dict[str, Any]:
    """The version-1 body as a dict (``docs/alerts-webhook.md``); times are epoch seconds."""
    alerts = list(notification.alerts) if alerts is None else alerts
    status = "firing" if any(a.status == "firing" for a in alerts) else "resolved"
    return {
        "version": VERSION,
        "receiver": notification.receiver,
        "status": status,
        "group_key": notification.group_key,
        "group_labels": dict(notification.group_labels),
        "external_url": notification.external_url,
        "alerts": [a.to_json() for a in alerts],
    }


def render(notification: Notification, alerts: list[NotifiedAlert] | None = None) -> bytes:
    """The exact bytes sent (compact UTF-8 JSON); the signature is computed over these."""
    return json.dumps(
        payload(notification, alerts), ensure_ascii=False, separators=(",", ":")
    ).encode()


class WebhookReceiver(HttpReceiver):
    type = "webhook"

    def request(
        self, notification: Notification, alerts: list[NotifiedAlert]
    ) -> tuple[str, bytes, dict[str, str]]:
        assert self.config.secret is not None  # ReceiverConfig requires it for webhooks
        body = render(notification, alerts)
        signature = sign(body, self.config.secret.get_secret_value())
        return self.config.url.get_secret_value(), body, {SIGNATURE_HEADER: signature}
