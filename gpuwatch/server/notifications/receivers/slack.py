"""Slack incoming webhooks: one Block Kit message per notification, with a plain-text fallback.

The message names each alert's summary and description (the rule puts the predicted
time to full there) and its culprits: user, command, memory, growth rate, pid and the
Slurm job, pod or container that holds the memory.

Outcomes (Slack's documented answers; see ``docs/alerts-webhook.md`` for the others)::

    200 "ok"                                   sent
    200 anything else                          broken  (not a Slack webhook, or a proxy)
    429 rate_limited                           retry   after Retry-After (header, else body)
    5xx, timeout, connection error             retry
    400 invalid_payload, 403 action_prohibited broken  (also 404 channel_not_found,
                                                        410 channel_is_archived, other 4xx)

Slack takes at most one message per second per webhook: ``min_interval_seconds`` is 1.
"""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime
from typing import Any

from gpuwatch.server.notifications.model import Attempt, Culprit, Notification, NotifiedAlert
from gpuwatch.server.notifications.receivers.base import HttpReceiver, Reply, classify, reason
from gpuwatch.server.notifications.receivers.text import (
    culprit_facts,
    culprits_text,
    cut,
    short_name,
    shorten,
)
from gpuwatch.terminal_text import printable

# Block Kit limits: 50 blocks a message, 150 characters a header, 3000 a section text.
MAX_ALERTS = 10
MAX_CULPRITS = 5
HEADER_CHARS = 150
SECTION_CHARS = 3000
FALLBACK_CHARS = 3000


class SlackReceiver(HttpReceiver):
    type = "slack"
    min_interval_seconds = 1.0

    def request(
        self, notification: Notification, alerts: list[NotifiedAlert]
    ) -> tuple[str, bytes, dict[str, str]]:
        body = json.dumps(render(notification, alerts), ensure_ascii=False).encode()
        return self.config.url.get_secret_value(), body, {}

    def judge(self, reply: Reply) -> Attempt:
        hint = None
        if reply.status_code == 429:
            hint = _body_retry_after(reply.body)
        attempt = classify(
            reply, label=self.label, redact=self.redact, now=self._clock(), retry_after=hint
        )
        if attempt.outcome == "sent" and reply.body.strip() != b"ok":
            # Slack answers exactly "ok"; anything else is not Slack taking the message.
            why = reason(reply.body, self.redact) or "(empty)"
            return Attempt(
                "broken",
                f"{self.label}: HTTP {reply.status_code} but the answer is not 'ok': {why}",
                status_code=reply.status_code,
            )
        return attempt


def _body_retry_after(body: bytes) -> float | None:
    """Slack's 429 body: ``{"retry_after":1,"ok":false,"error":"rate_limited"}``."""
    try:
        value = json.loads(body).get("retry_after")
    except (ValueError, AttributeError):
        return None
    return float(value) if isinstance(value, int | float) and value >= 0 else None


def render(notification: Notification, alerts: list[NotifiedAlert] | None = None) -> dict[str, Any]:
    """The Slack message: ``text`` (fallback, notifications) and ``blocks`` (Block Kit)."""
    alerts = list(notification.alerts) if alerts is None else alerts
    title = _title(alerts)
    blocks: list[dict[str, Any]] = [
        {"type": "header", "text": {"type": "plain_text", "text": shorten(title, HEADER_CHARS)}}
    ]
    for index, alert in enumerate(alerts[:MAX_ALERTS]):
        if index:
            blocks.append({"type": "divider"})
        blocks.extend(_alert_blocks(alert))
    if len(alerts) > MAX_ALERTS:
        blocks.append(_context(f"…and {len(alerts) - MAX_ALERTS} more alerts"))
    if notification.external_url:
        blocks.append(
            {
                "type": "actions",
                "elements": [
                    {
                        "type": "button",
                        "text": {"type": "plain_text", "text": "Open gpuwatch"},
                        "url": notification.external_url,
                    }
                ],
            }
        )
    return {"text": _fallback(title, alerts), "blocks": blocks}


def _title(alerts: list[NotifiedAlert]) -> str:
    firing = sum(a.status == "firing" for a in alerts)
    resolved = len(alerts) - firing
    rules = sorted({a.rule for a in alerts})
    subject = rules[0] if len(rules) == 1 else f"{len(rules)} rules"
    head = f"🔥 Firing: {subject}" if firing else f"✅ Resolved: {subject}"
    if len(alerts) > 1:
        counts = [f"{firing} firing"] if firing else []
        counts += [f"{resolved} resolved"] if resolved else []
        head += f" ({', '.join(counts)})"
    return head


def _fallback(title: str, alerts: list[NotifiedAlert]) -> str:
    """Plain text for notifications and clients without Block Kit: summary and culprits."""
    parts = []
    for alert in alerts[:MAX_ALERTS]:
        part = alert.summary
        if alert.culprits:
            part += f" — culprits: {culprits_text(alert.culprits[:MAX_CULPRITS], limit=500)}"
        parts.append(part)
    return _escaped_within(
        shorten(f"{title}: " + " | ".join(parts), FALLBACK_CHARS), FALLBACK_CHARS
    )


def _alert_blocks(alert: NotifiedAlert) -> list[dict[str, Any]]:
    icon = "🔴" if alert.status == "firing" else "✅"
    text = f"{icon} *{_inline(shorten(alert.summary, 300))}*"
    if alert.description:
        # Not shorten(): a description may be laid out in lines (each one made
        # printable here too, whoever built it).
        described = "\n".join(printable(line) for line in alert.description.split("\n"))
        text += f"\n{_inline(cut(described, 1500))}"
    blocks = [_section(text)]
    if alert.culprits:
        lines = [_culprit_mrkdwn(c) for c in alert.culprits[:MAX_CULPRITS]]
        if len(alert.culprits) > MAX_CULPRITS:
            lines.append(f"…and {len(alert.culprits) - MAX_CULPRITS} more")
        blocks.append(_section("*Culprits*\n" + "\n".join(lines)))
    # Label values (a user name, a hostname) come from agents: one line, bounded.
    labels = " ".join(
        f"`{_code(k)}={_code(short_name(v, ''))}`"
        for k, v in sorted(alert.labels.items())
        if k != "rule"
    )
    when = f"since {_date(alert.starts_at)}"
    if alert.ends_at is not None:
        when += f", resolved {_date(alert.ends_at)}"
    blocks.append(_context(f"`{_code(alert.rule)}` {labels} · {when}".replace("  ", " ")))
    return blocks


def _culprit_mrkdwn(culprit: Culprit) -> str:
    # The owner's name is anyone's to choose (a host token holder pushes it; /etc/passwd
    # takes 256 characters): treated like the command, and kept from formatting the line.
    who = _inline(short_name(culprit.user, "unknown user"))
    command = _code(shorten(culprit.command or "unknown command", 80))
    return f"• *{who}* `{command}` — {_inline(', '.join(culprit_facts(culprit)))}"


def _section(text: str) -> dict[str, Any]:
    return {"type": "section", "text": _mrkdwn(_within(text, SECTION_CHARS))}


def _context(text: str) -> dict[str, Any]:
    return {"type": "context", "elements": [_mrkdwn(_within(text, SECTION_CHARS))]}


def _mrkdwn(text: str) -> dict[str, Any]:
    # verbatim: Slack does not turn a bare URL or channel name in a user's command line
    # into a link; what gpuwatch writes as <...> (the date token) still works.
    return {"type": "mrkdwn", "text": text, "verbatim": True}


def _date(epoch: float) -> str:
    """Slack's date token: shown in the reader's time zone, with a UTC fallback."""
    fallback = datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%d %H:%M UTC")
    return f"<!date^{int(epoch)}^{{date_short_pretty}} {{time}}|{fallback}>"


def _escape(text: str) -> str:
    """Slack mrkdwn control characters (https://api.slack.com/reference/surfaces/formatting)."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


# Slack has no escape for its formatting marks. In text from users outside a code span
# (a summary naming a command, an owner's name), a "*" closed the bold around it and
# "_x_" or "~x~" restyled what followed: they are shown as look-alikes instead (an
# underscore only at a word's edge, where Slack reads it as a mark: svc_ml is left
# alone). A backtick only starts a code span, inside which nothing is formatted. The
# exact text is in the command's code span, the webhook and the API.
_MARKS = str.maketrans({"*": "∗", "~": "∼"})
_EDGE_UNDERSCORE = re.compile(r"(?<![A-Za-z0-9])_|_(?![A-Za-z0-9])")


def _inline(text: str) -> str:
    """User-given text for mrkdwn outside a code span: escaped, and unable to format."""
    return _EDGE_UNDERSCORE.sub("ˍ", _escape(text).translate(_MARKS))


def _within(text: str, limit: int) -> str:
    """Escaped ``text`` in at most ``limit`` characters, cut neither inside an entity
    (``&amp;``) nor inside an escape printable() wrote (``\\u202e``)."""
    if len(text) <= limit:
        return text
    head = cut(text, limit)[:-1]
    amp = head.rfind("&")
    if amp >= len(head) - 4 and ";" not in head[amp:]:
        head = head[:amp]  # never half an entity
    return head + "…"


def _escaped_within(text: str, limit: int) -> str:
    """``_escape(text)`` in at most ``limit`` characters: escaping lengthens the text
    (``<`` is four characters more), so cutting before it overran Slack's limit."""
    return _within(_escape(text), limit)


def _code(text: str) -> str:
    """Text for inside a `code` span: escaped, with no backtick to close it early."""
    return _escape(text.replace("`", "'"))
