"""The alerts page: what fires (and what is about to), the silences, the receivers.

Read-only: silences are created and expired with ``gpuwatch alerts silence`` or the API
(which need the admin token when one is set)."""

from __future__ import annotations

from collections.abc import Sequence
from html import escape as e

from gpuwatch.server.alerts.schemas import AlertOut, ReceiverOut, SilenceOut
from gpuwatch.server.web.format import ago, host_path, size, tooltip, when
from gpuwatch.server.web.templates.layout import (
    Chrome,
    cell_text,
    command_text,
    page,
    table,
    text,
)
from gpuwatch.terminal_text import printable


def alerts_page(
    chrome: Chrome,
    alerts: Sequence[AlertOut],
    silences: Sequence[SilenceOut],
    receivers: Sequence[ReceiverOut],
) -> str:
    firing = [a for a in alerts if a.state == "firing"]
    pending = [a for a in alerts if a.state == "pending"]
    body = (
        f'<h1>Alerts</h1><h2>Firing <span class="count">{len(firing)}</span></h2>'
        f"{_alerts(chrome, firing, empty='Nothing is firing.')}"
        f'<h2>Pending <span class="count">{len(pending)}</span></h2>'
        f"{_alerts(chrome, pending, empty='Nothing is pending.')}"
        f'<h2>Silences <span class="count">{len(silences)}</span></h2>{_silences(silences)}'
        f"<h2>Receivers</h2>{_receivers(chrome, receivers)}"
    )
    return page(chrome, title="Alerts", active="alerts", body=body)


def _alerts(chrome: Chrome, alerts: Sequence[AlertOut], *, empty: str) -> str:
    rows = []
    for alert in alerts:
        where = _where(chrome, alert.labels)
        culprits = "<br>".join(
            f"pid {c.pid} {cell_text(c.user or '?')} {size(c.memory_bytes)}"
            + (f" {command_text(c.command)}" if c.command else "")
            for c in alert.culprits
        )
        muted = (
            f'<span class="badge silenced">silenced by {", ".join(f"#{s}" for s in alert.silenced_by)}</span>'
            if alert.silenced_by
            else ""
        )
        since = alert.starts_at if alert.starts_at is not None else alert.active_since
        rows.append(
            [
                f'<span class="severity {e(alert.severity)}">{e(alert.severity)}</span>',
                e(alert.rule),
                where,
                f"<b>{text(alert.summary)}</b>{_description(alert.description)}{muted}",
                culprits,
                f'<span title="{when(since)}">{ago(since, chrome.now)}</span>',
            ]
        )
    return table(
        ["Severity", "Rule", "Where", "Summary", "Culprits", "Since"],
        rows,
        empty=empty,
        css="alerts",
    )


# Characters of a description line shown; a longer line is whole in its tooltip.
DESCRIPTION_LINE_CHARS = 240


def _description(description: str) -> str:
    """An alert's description, a line per culprit (rules.describe) or the detail its
    event gave: each line shown as :func:`text`, so a line break is a break, not the
    escape ``\\n`` that a control character inside a line is shown as; a line past
    ``DESCRIPTION_LINE_CHARS`` is cut, whole in its tooltip, so one row stays a row."""
    lines = [_line(line) for line in description.split("\n") if line]
    return f'<div class="muted">{"<br>".join(lines)}</div>' if lines else ""


def _line(line: str) -> str:
    shown = printable(line)
    if len(shown) <= DESCRIPTION_LINE_CHARS:
        return text(line)
    return f'<bdi title="{tooltip(line)}">{e(shown[: DESCRIPTION_LINE_CHARS - 1])}…</bdi>'


def _where(chrome: Chrome, labels: dict[str, str]) -> str:
    host = labels.get("hostname")
    if host is None:
        return ""
    gpu = labels.get("gpu")
    if gpu is not None and gpu.isascii() and gpu.isdigit():
        href = host_path(chrome.root, host, gpu)
        return f'<a href="{href}">{cell_text(host)} GPU {e(gpu)}</a>'
    return f'<a href="{host_path(chrome.root, host)}">{cell_text(host)}</a>'


def _silences(silences: Sequence[SilenceOut]) -> str:
    rows = []
    for s in silences:
        matchers = " ".join(
            f"<code>{text(m.name)}{'=~' if m.regex else '='}{text(m.value)}</code>"
            for m in s.matchers
        )
        rows.append(
            [
                f"#{s.id}",
                f'<span class="badge {e(s.state)}">{e(s.state)}</span>',
                matchers,
                when(s.starts_at),
                when(s.ends_at),
                text(s.created_by),
                text(s.comment),
            ]
        )
    return table(
        ["Id", "State", "Matchers", "From", "Until", "By", "Comment"],
        rows,
        empty="No active or pending silence. Create one with: gpuwatch alerts silence add",
        css="silences",
    )


def _receivers(chrome: Chrome, receivers: Sequence[ReceiverOut]) -> str:
    rows = [
        [
            e(r.name),
            e(r.type),
            f'<span class="badge {e(r.status)}">{e(r.status)}</span>',
            ago(r.last_sent_at, chrome.now) if r.last_sent_at else "never",
            str(r.pending),
            text(r.last_error or ""),
        ]
        for r in receivers
    ]
    return table(
        ["Name", "Type", "Status", "Last sent", "Pending", "Last error"],
        rows,
        empty="No receiver is configured ([[server.receivers]] in the config).",
        css="receivers",
    )
