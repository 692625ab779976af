"""The event timeline: filters (host, GPU, user, kind, state, time range), a chart with
one lane per kind, and the list, newest first, a page at a time."""

from __future__ import annotations

import calendar
import time
from collections.abc import Sequence
from html import escape as e
from typing import NamedTuple
from urllib.parse import urlencode

from gpuwatch.server.events.models import EVENT_KINDS
from gpuwatch.server.events.schemas import EventOut
from gpuwatch.server.web.charts import Mark, event_timeline, overlaps
from gpuwatch.server.web.format import ago, duration, host_path, size, when
from gpuwatch.server.web.templates.layout import (
    Chrome,
    cell_text,
    kind_badge,
    page,
    table,
    text,
)

# The latest time a filter takes: the snapshots' Epoch maximum (year 2242).
MAX_EPOCH = float(2**33)


class EventFilters(NamedTuple):
    """The filters as the form shows them (strings, "" when unset) and as parsed."""

    host: str
    gpu: str
    user: str
    kind: str
    state: str  # "", "open" or "ended"
    since: str  # "YYYY-MM-DDTHH:MM" in UTC, as a datetime-local input holds it
    until: str

    def query(self, **extra: str) -> str:
        fields = {k: v for k, v in self._asdict().items() if v} | extra
        return urlencode(fields)


def events_page(
    chrome: Chrome,
    filters: EventFilters,
    events: Sequence[EventOut],
    *,
    since: float,
    until: float,
    next_cursor: str | None,
    error: str | None,
) -> str:
    """``since``/``until``: the chart's range (the filter's, or the events' own)."""
    marks = [(Mark(ev.kind, ev.started_at, ev.ended_at, ev.summary, ev.pid), ev.hostname)
             for ev in events]  # fmt: skip
    chart = event_timeline(marks, since=since, until=until, width=1100)
    more = ""
    if next_cursor is not None:
        href = e(f"{chrome.root}/events?{filters.query(cursor=next_cursor)}")
        more = f'<p><a class="more" href="{href}">Older events →</a></p>'
    problem = f'<p class="error">{e(error)}</p>' if error else ""
    outside = sum(not overlaps(mark, since, until) for mark, _ in marks)
    undrawn = f" ({outside} listed events lie outside it and are not drawn)" if outside else ""
    body = (
        f"<h1>Events</h1>{_form(chrome, filters)}{problem}"
        f'<p class="meta">{len(events)} events shown, newest first; the chart spans '
        f"{when(since)} to {when(until)}{undrawn}.</p>"
        f'<section class="card wide">{chart or "<p class=empty>Nothing to chart.</p>"}</section>'
        f"{events_table(chrome, events, with_host=True)}{more}"
    )
    return page(chrome, title="Events", active="events", body=body)


def _form(chrome: Chrome, f: EventFilters) -> str:
    kinds = "".join(
        f'<option value="{kind}"{" selected" if kind == f.kind else ""}>{kind}</option>'
        for kind in EVENT_KINDS
    )
    states = "".join(
        f'<option value="{value}"{" selected" if value == f.state else ""}>{label}</option>'
        for value, label in (("", "open or ended"), ("open", "open"), ("ended", "ended"))
    )
    return (
        f'<form class="filters" method="get" action="{e(chrome.root)}/events">'
        f'<label>Host <input name="host" value="{e(f.host)}" maxlength="256"></label>'
        f'<label>GPU <input name="gpu" value="{e(f.gpu)}" inputmode="numeric" size="3" '
        'pattern="[0-9]*"></label>'
        f'<label>User <input name="user" value="{e(f.user)}" maxlength="256"></label>'
        f'<label>Kind <select name="kind"><option value="">any</option>{kinds}</select></label>'
        f'<label>State <select name="state">{states}</select></label>'
        f'<label>From (UTC) <input type="datetime-local" name="since" value="{e(f.since)}">'
        "</label>"
        f'<label>To (UTC) <input type="datetime-local" name="until" value="{e(f.until)}">'
        "</label>"
        '<button type="submit">Filter</button>'
        f'<a href="{e(chrome.root)}/events">clear</a></form>'
    )


def events_table(chrome: Chrome, events: Sequence[EventOut], *, with_host: bool) -> str:
    rows = []
    for ev in events:
        if ev.ended_at is None:
            ended = f'<span class="badge open">open</span> {duration(chrome.now - ev.started_at)}'
        else:
            ended = "–" if ev.ended_at == ev.started_at else duration(ev.ended_at - ev.started_at)
        gpu = ""
        if ev.gpu_index is not None:
            href = host_path(chrome.root, ev.hostname, ev.gpu_index)
            gpu = f'<a href="{href}">{ev.gpu_index}</a>'
        row = [
            when(ev.started_at),
            ended,
            kind_badge(ev.kind),
            gpu,
            "" if ev.pid is None else str(ev.pid),
            cell_text(ev.user or ""),
            size(ev.held_bytes) if ev.held_bytes is not None else "",
            text(ev.summary) + _as_of(chrome, ev),
        ]
        if with_host:
            href = host_path(chrome.root, ev.hostname)
            row.insert(3, f'<a href="{href}">{cell_text(ev.hostname)}</a>')
        rows.append(row)
    headers = ["Started", "Lasted", "Kind", "GPU", "PID", "User", "Held", "Summary"]
    if with_host:
        headers.insert(3, "Host")
    return table(headers, rows, empty="No events.", css="events")


# How old an open event's summary may be before the page says when it was written: the
# detectors refresh it when they look again (the idle detector once per sample
# interval), so a figure in it ("no SM activity for 18 s") is as of then, not now.
SUMMARY_FRESH_SECONDS = 60.0


def _as_of(chrome: Chrome, ev: EventOut) -> str:
    if ev.ended_at is not None or chrome.now - ev.last_seen_at <= SUMMARY_FRESH_SECONDS:
        return ""
    return (
        f' <span class="muted" title="{when(ev.last_seen_at)}">'
        f"(as of {ago(ev.last_seen_at, chrome.now)})</span>"
    )


def parse_utc(value: str) -> float | None:
    """``"2027-01-15T08:00"`` (a datetime-local value, read as UTC) or epoch seconds ->
    epoch seconds; None when empty. ValueError when it is neither, or out of range."""
    value = value.strip()
    if not value:
        return None
    seconds = _seconds(value)
    # float() takes "inf", "nan" and 1e308, which no calendar can print (the page was a
    # 500): only the range the API's Epoch takes, 0 to 2**33 (year 2242).
    if not 0 <= seconds <= MAX_EPOCH:
        raise ValueError(f"out of range: {value!r} (from 1970 to the year 2242)")
    return seconds


def _seconds(value: str) -> float:
    try:
        return float(value)
    except ValueError:
        pass
    for pattern in ("%Y-%m-%dT%H:%M", "%Y-%m-%dT%H:%M:%S", "%Y-%m-%d"):
        try:
            return float(calendar.timegm(time.strptime(value, pattern)))
        except ValueError:
            continue
    raise ValueError(f"not a time: {value!r} (use YYYY-MM-DDTHH:MM, UTC)")


def format_utc(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M", time.gmtime(t))
