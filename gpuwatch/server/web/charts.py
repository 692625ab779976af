"""Inline SVG charts, drawn on the server: pure functions from data to markup.

No charting library and no script: a chart is a few ``<path>`` elements the browser
paints with the page. Colours are presentation attributes, not ``style``, so the
pages' Content-Security-Policy needs no ``unsafe-inline``. Every string that came from
an agent (users, commands, summaries) is escaped here.

Sizes are bytes, times Unix epoch seconds; charts label them in GiB and UTC.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from html import escape
from typing import NamedTuple

from gpuwatch.server.web.format import clock_label, size, tooltip, when
from gpuwatch.server.web.service import History, Layer

GIB = 2**30
# Distinct, colour-blind-friendlier hues (Okabe-Ito and Tableau); a user keeps one.
PALETTE = (
    "#4e79a7",
    "#f28e2b",
    "#59a14f",
    "#b07aa1",
    "#edc948",
    "#76b7b2",
    "#ff9da7",
    "#9c755f",
    "#0072b2",
    "#d55e00",
    "#009e73",
    "#cc79a7",
)
OTHER_COLOUR = "#bab0ac"
# Event kinds, the colour of their marks, and whether they are drawn as a span (a
# condition that lasts) or a line (a moment).
KIND_COLOURS = {
    "orphaned": "#c2185b",
    "runaway": "#e65100",
    "idle": "#1e88e5",
    "filling_up": "#d32f2f",
    "gpu_lost": "#616161",
    "gpu_back": "#2e7d32",
    "agent_silent": "#8d6e63",
    "reaped": "#6a1b9a",
    "oom": "#b71c1c",
}
POINT_KINDS = frozenset({"gpu_back", "reaped", "oom"})
_DAY = 86400
_YEAR = 365 * _DAY
_TIME_STEPS = (60, 300, 900, 1800, 3600, 3 * 3600, 6 * 3600, 12 * 3600, _DAY, 2 * _DAY, 7 * _DAY,
               14 * _DAY, 30 * _DAY, 91 * _DAY, 182 * _DAY, _YEAR)  # fmt: skip
# Labels on a time axis at most (a step of whole years past the steps above): an event
# dated decades back (the events page's chart spans the events shown) stays 7 labels.
_MAX_TICKS = 7
_GIB_STEPS = (0.25, 0.5, 1, 2, 5, 10, 20, 40, 80, 160, 320, 640, 1280)


def user_colour(user: str | None) -> str:
    """The same colour for the same user on every chart (a stable hash, not ``hash``)."""
    if user is None:
        return OTHER_COLOUR
    return PALETTE[zlib.crc32(user.encode()) % len(PALETTE)]


class Mark(NamedTuple):
    """An event drawn on a timeline: a span from ``started_at`` to ``ended_at`` (None:
    still open) or, for point kinds, a line at ``started_at``."""

    kind: str
    started_at: float
    ended_at: float | None
    summary: str
    pid: int | None


class _Frame(NamedTuple):
    """Plot area in pixels and the data ranges it maps."""

    left: int
    top: int
    width: int
    height: int
    t0: float
    t1: float
    ymax: float

    def x(self, t: float) -> float:
        span = self.t1 - self.t0 or 1.0
        return self.left + (min(max(t, self.t0), self.t1) - self.t0) / span * self.width

    def y(self, value: float) -> float:
        return self.top + self.height - value / (self.ymax or 1.0) * self.height


def memory_chart(
    history: History,
    marks: Sequence[Mark],
    *,
    width: int,
    height: int,
    label: str,
    now: float,
) -> str:
    """Memory per process, stacked, over the history's range; the GPU's used memory as
    a line, its capacity dashed, and events marked on a lane beneath (spans) or across
    the plot (reaps, OOMs, GPU returns)."""
    # The lane beneath the plot: one row per kind of span drawn, so spans that overlap
    # in time (a leak and the filling-up it causes) stay visible side by side.
    span_kinds = [
        k for k in KIND_COLOURS if k not in POINT_KINDS and any(m.kind == k for m in marks)
    ]
    lane = max(8, 7 * len(span_kinds) + 2)
    frame = _Frame(
        left=52,
        top=8,
        width=width - 60,
        height=height - 8 - 22 - lane - 4,
        t0=history.since,
        t1=history.until,
        ymax=_y_max(history),
    )
    columns = len(history.used)
    xs = [round(frame.x(history.since + (k + 0.5) * history.step), 1) for k in range(columns)]
    parts = [
        f'<svg class="chart" viewBox="0 0 {width} {height}" role="img" '
        f'aria-label="{tooltip(label)}">',
        _y_axis(frame),
        _x_axis(frame, frame.top + frame.height + lane + 4),
    ]
    base = [0] * columns
    # y of a value, inlined (frame.y per point was most of a host page's time).
    bottom, scale = frame.top + frame.height, frame.height / (frame.ymax or 1.0)
    for layer in history.layers:
        top = [b + v for b, v in zip(base, layer.values, strict=True)]
        # Only the columns where the layer has thickness, and one either side, where it
        # meets the layer beneath: a short job's band is a few points, not every column.
        held = [k for k, v in enumerate(layer.values) if v]
        if not held:
            continue
        first, last = max(0, held[0] - 1), min(columns, held[-1] + 2)
        upper = " L".join(
            f"{x},{bottom - v * scale:.1f}"
            for x, v in zip(xs[first:last], top[first:last], strict=True)
        )
        lower = " L".join(
            f"{x},{bottom - v * scale:.1f}"
            for x, v in zip(reversed(xs[first:last]), reversed(base[first:last]), strict=True)
        )
        colour = OTHER_COLOUR if layer.lifetime_id is None else user_colour(layer.user)
        parts.append(
            f'<path class="layer" d="M{upper} L{lower} Z" fill="{colour}" fill-opacity="0.85" '
            f'stroke="#fff" stroke-width="0.5"><title>{tooltip(_layer_title(layer))}</title></path>'
        )
        base = top
    used = _polyline(frame, xs, history.used)
    if used:
        parts.append(
            f'<path class="used" d="{used}" fill="none" stroke="#222" stroke-width="1.5">'
            "<title>GPU memory used</title></path>"
        )
    if history.total_bytes:
        y = frame.y(history.total_bytes)
        parts.append(
            f'<line class="total" x1="{frame.left}" x2="{frame.left + frame.width}" y1="{y:.1f}" '
            f'y2="{y:.1f}" stroke="#222" stroke-dasharray="4 3"><title>capacity '
            f"{escape(size(history.total_bytes))}</title></line>"
        )
    parts.append(
        _marks(frame, marks, span_kinds, lane_top=frame.top + frame.height + 2, lane=lane, now=now)
    )
    parts.append("</svg>")
    return "".join(parts)


def _y_max(history: History) -> float:
    stacked = max(
        (sum(column) for column in zip(*(layer.values for layer in history.layers), strict=True)),
        default=0,
    )
    used = max((u for u in history.used if u is not None), default=0)
    return float(max(history.total_bytes or 0, stacked, used, GIB))


def _layer_title(layer: Layer) -> str:
    if layer.lifetime_id is None:
        return f"{layer.processes} smaller processes, peak {size(layer.peak_bytes)}"
    who = layer.user or "unknown user"
    return f"pid {layer.pid} ({who}), peak {size(layer.peak_bytes)}: {layer.command or ''}"


def _polyline(frame: _Frame, xs: list[float], values: Sequence[int | None]) -> str:
    """An SVG path through the known values; a gap where a value is missing."""
    out: list[str] = []
    pen_down = False
    for x, value in zip(xs, values, strict=True):
        if value is None:
            pen_down = False
            continue
        out.append(f"{'L' if pen_down else 'M'}{x},{frame.y(value):.1f}")
        pen_down = True
    return " ".join(out)


def _y_axis(frame: _Frame) -> str:
    step = next((s for s in _GIB_STEPS if frame.ymax / GIB / s <= 5), _GIB_STEPS[-1]) * GIB
    parts = []
    value = 0.0
    while value <= frame.ymax + 1:
        y = frame.y(value)
        parts.append(
            f'<line x1="{frame.left}" x2="{frame.left + frame.width}" y1="{y:.1f}" y2="{y:.1f}" '
            f'stroke="#e0e0e0"/><text class="tick" x="{frame.left - 4}" y="{y + 3:.1f}" '
            f'text-anchor="end">{value / GIB:g} GiB</text>'
        )
        value += step
    return "".join(parts)


def _x_axis(frame: _Frame, baseline: float) -> str:
    span = frame.t1 - frame.t0
    step = next(
        (s for s in _TIME_STEPS if span / s <= _MAX_TICKS),
        math.ceil(span / _MAX_TICKS / _YEAR) * _YEAR,
    )
    parts = []
    t = (frame.t0 // step + 1) * step
    while t < frame.t1:
        x = frame.x(t)
        parts.append(
            f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{frame.top}" y2="{baseline}" stroke="#eee"/>'
            f'<text class="tick" x="{x:.1f}" y="{baseline + 14}" text-anchor="middle">'
            f"{clock_label(t, span)}</text>"
        )
        t += step
    return "".join(parts)


def _marks(
    frame: _Frame,
    marks: Sequence[Mark],
    span_kinds: list[str],
    *,
    lane_top: float,
    lane: int,
    now: float,
) -> str:
    parts = []
    for mark in marks:
        colour = KIND_COLOURS.get(mark.kind, "#555")
        title = tooltip(f"{mark.kind} at {when(mark.started_at)}: {mark.summary}")
        x0 = frame.x(mark.started_at)
        if mark.kind in POINT_KINDS:
            parts.append(
                f'<g class="mark point {escape(mark.kind)}"><title>{title}</title>'
                f'<line x1="{x0:.1f}" x2="{x0:.1f}" y1="{frame.top}" y2="{lane_top + lane}" '
                f'stroke="{colour}" stroke-width="1.5" stroke-dasharray="3 2"/>'
                f'<circle cx="{x0:.1f}" cy="{lane_top + lane / 2:.1f}" r="4" fill="{colour}"/></g>'
            )
            continue
        x1 = frame.x(now if mark.ended_at is None else mark.ended_at)
        row = span_kinds.index(mark.kind) if mark.kind in span_kinds else 0
        parts.append(
            f'<rect class="mark span {escape(mark.kind)}" x="{x0:.1f}" '
            f'y="{lane_top + 1 + 7 * row:.1f}" width="{max(2.0, x1 - x0):.1f}" height="6" '
            f'fill="{colour}" rx="2"><title>{title}</title></rect>'
        )
    return "".join(parts)


def event_timeline(
    events: Sequence[tuple[Mark, str]], *, since: float, until: float, width: int
) -> str:
    """One lane per event kind over ``[since, until]``: spans for conditions, ticks for
    moments. ``events`` pairs each mark with the host it is about (for its tooltip)."""
    kinds = [kind for kind in KIND_COLOURS if any(m.kind == kind for m, _ in events)]
    if not kinds:
        return ""
    lane = 18
    height = 8 + lane * len(kinds) + 24
    frame = _Frame(110, 8, width - 120, lane * len(kinds), since, until, 1.0)
    parts = [
        f'<svg class="chart timeline" viewBox="0 0 {width} {height}" role="img" '
        'aria-label="event timeline">',
        _x_axis(frame, frame.top + frame.height),
    ]
    for row, kind in enumerate(kinds):
        y = frame.top + row * lane
        colour = KIND_COLOURS[kind]
        parts.append(
            f'<text class="lane" x="{frame.left - 6}" y="{y + lane - 6}" text-anchor="end">'
            f"{kind}</text>"
        )
        for mark, host in events:
            if mark.kind != kind or not overlaps(mark, since, until):
                continue
            title = tooltip(f"{host}: {mark.summary} ({when(mark.started_at)})")
            x0 = frame.x(mark.started_at)
            if kind in POINT_KINDS:
                parts.append(
                    f'<rect class="mark" x="{x0 - 1:.1f}" y="{y + 2}" width="3" '
                    f'height="{lane - 4}" fill="{colour}"><title>{title}</title></rect>'
                )
            else:
                x1 = frame.x(until if mark.ended_at is None else mark.ended_at)
                parts.append(
                    f'<rect class="mark" x="{x0:.1f}" y="{y + 3}" width="{max(2.0, x1 - x0):.1f}" '
                    f'height="{lane - 6}" fill="{colour}" fill-opacity="0.8" rx="2">'
                    f"<title>{title}</title></rect>"
                )
    parts.append("</svg>")
    return "".join(parts)


def overlaps(mark: Mark, since: float, until: float) -> bool:
    """Whether ``mark`` has any part in ``[since, until]`` (one outside is listed, not
    drawn at the chart's edge as if it happened then)."""
    end = until if mark.ended_at is None else mark.ended_at
    return mark.started_at <= until and end >= since


def fullness_bar(counts: Sequence[tuple[str, int, str]], *, width: int, height: int = 18) -> str:
    """A horizontal bar split by ``(label, count, css class)``; each part's tooltip
    gives its count."""
    total = sum(count for _, count, _ in counts) or 1
    parts = [
        f'<svg class="bar" viewBox="0 0 {width} {height}" width="{width}" height="{height}" '
        f'role="img" aria-label="GPUs by fullness">'
    ]
    x = 0.0
    for label, count, css in counts:
        if not count:
            continue
        w = count / total * width
        parts.append(
            f'<rect class="{css}" x="{x:.1f}" y="0" width="{w:.1f}" height="{height}">'
            f"<title>{escape(label)}: {count} GPUs</title></rect>"
        )
        x += w
    parts.append("</svg>")
    return "".join(parts)
