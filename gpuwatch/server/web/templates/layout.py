"""The frame every page shares (head, navigation, footer) and small HTML helpers.

Templates are plain Python functions returning strings: no template engine to load,
and the fleet page's thousands of tiles render in a tight loop. Anything that came
from an agent or a user goes through :func:`html.escape` (``e`` here) before it lands
in markup.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from html import escape as e
from typing import NamedTuple

from gpuwatch import __version__
from gpuwatch.server.web.format import path, tooltip, when
from gpuwatch.terminal_text import printable

STATIC = "/static/dashboard"
NAV = (("fleet", "Fleet", ""), ("events", "Events", "events"), ("alerts", "Alerts", "alerts"))
# Detail pages' time ranges: query value -> (seconds, label).
RANGES = {"1h": (3600, "1 h"), "6h": (6 * 3600, "6 h"), "24h": (86400, "24 h"),
          "7d": (7 * 86400, "7 d"), "30d": (30 * 86400, "30 d")}  # fmt: skip
DEFAULT_RANGE = "6h"


class Chrome(NamedTuple):
    """What the frame shows around a page."""

    root: str  # the ASGI root path links start with
    now: float
    firing: int  # firing alerts, in the navigation
    sign_out: bool  # signed in with the cookie: offer to sign out


def page(chrome: Chrome, *, title: str, active: str, body: str, refresh: bool = True) -> str:
    """A whole document. ``refresh``: the page offers auto-refresh (live data)."""
    root = e(chrome.root)
    nav = []
    for key, label, segment in NAV:
        current = ' aria-current="page"' if key == active else ""
        badge = ""
        if key == "alerts" and chrome.firing:
            badge = f' <span class="badge firing">{chrome.firing}</span>'
        href = path(chrome.root, segment) if segment else f"{root}/"
        nav.append(f'<a href="{href}"{current}>{label}{badge}</a>')
    nav.append(f'<a href="{root}/docs">API</a>')
    tools = []
    if refresh:
        tools.append(
            '<label class="refresh"><input type="checkbox" id="autorefresh"> auto-refresh</label>'
        )
    if chrome.sign_out:
        tools.append(
            f'<form method="post" action="{root}/logout" class="signout">'
            '<button type="submit">Sign out</button></form>'
        )
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{e(printable(title))} · gpuwatch</title>"
        f'<link rel="icon" href="{root}{STATIC}/favicon.svg" type="image/svg+xml">'
        f'<link rel="stylesheet" href="{root}{STATIC}/dashboard.css">'
        f'<script src="{root}{STATIC}/dashboard.js" defer></script>'
        f'</head><body data-page="{e(active)}">'
        f'<header class="top"><a class="brand" href="{root}/">gpuwatch</a>'
        f'<nav>{"".join(nav)}</nav><span class="spacer"></span>{"".join(tools)}</header>'
        f"<main>{body}</main>"
        f"<footer>Rendered {when(chrome.now)} (UTC) by gpuwatch {e(__version__)}. "
        "Times are UTC; sizes binary (GiB).</footer></body></html>"
    )


def table(
    headers: Sequence[str], rows: Iterable[Sequence[str]], *, empty: str, css: str = ""
) -> str:
    """A table of already-escaped cells; ``empty`` when there are no rows."""
    body = "".join("<tr>" + "".join(f"<td>{cell}</td>" for cell in row) + "</tr>" for row in rows)
    if not body:
        return f'<p class="empty">{e(empty)}</p>'
    head = "".join(f"<th>{e(h)}</th>" for h in headers)
    return f'<table class="{css}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def ranges(chrome: Chrome, base: str, current: str) -> str:
    """The time-range switch of a detail page; ``base`` is the page's escaped URL."""
    links = []
    # A host named "." or ".." is addressed by a query (format.host_path): add to it.
    join = "&amp;" if "?" in base else "?"
    for key, (_, label) in RANGES.items():
        current_attr = ' aria-current="true"' if key == current else ""
        links.append(f'<a href="{base}{join}range={key}"{current_attr}>{label}</a>')
    return f'<nav class="ranges" aria-label="time range">{"".join(links)}</nav>'


def text(value: str) -> str:
    """Text an agent or a user sent, escaped and isolated (``<bdi>``): right-to-left
    text cannot reorder what follows it, and direction overrides and other invisible
    characters in it are shown as escapes (``\\u202e``), as in tooltips, so one cannot
    reverse the value itself either (a command ``"…\\u202eexe.txt"`` drawn as
    ``"…txt.exe"``). Right-to-left letters are shown as they are."""
    return f"<bdi>{e(printable(value))}</bdi>"


def cell_text(value: str) -> str:
    """A name in a table column that does not wrap (a user, a host, a job id): shown
    as :func:`text` and cut by the stylesheet to a width (``bdi.cut``), with its whole
    value in the title, so one 256-character name cannot push the table past the
    window."""
    return f'<bdi class="cut" title="{tooltip(value)}">{e(printable(value))}</bdi>'


# Characters of a command shown in a table; the whole command is in its tooltip.
COMMAND_CHARS = 120


def command_text(command: str | None) -> str:
    """A command line as every table shows it: as :func:`text`, cut to
    ``COMMAND_CHARS`` characters (an ellipsis says so), and whole in its tooltip."""
    if not command:
        return ""
    shown = printable(command)
    if len(shown) > COMMAND_CHARS:
        shown = shown[: COMMAND_CHARS - 1] + "…"
    return f'<code title="{tooltip(command)}"><bdi>{e(shown)}</bdi></code>'


def kind_badge(kind: str) -> str:
    return f'<span class="kind {e(kind)}">{e(kind.replace("_", " "))}</span>'


def not_found(chrome: Chrome, what: str) -> str:
    return page(
        chrome,
        title="Not found",
        active="",
        body=f'<h1>Not found</h1><p class="empty">{e(what)}</p>'
        f'<p><a href="{e(chrome.root)}/">Back to the fleet</a></p>',
        refresh=False,
    )
