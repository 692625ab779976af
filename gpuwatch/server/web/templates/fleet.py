"""The fleet page: every GPU as a tile, coloured by fullness, grouped by host.

A tile's colour is its used/total in tenths (grey when its reading is stale or lost);
its text is the owner of its largest process ("+" when other users hold some too);
corner marks and borders flag open events (orphaned, idle, filling up, runaway). It
links to the GPU's page, and its tooltip (written by dashboard.js on hover or focus
from the tile's ``data-v`` figures) has the memory, the holders and the flags in words.

At 8,000 GPUs this is the only loop over the tiles, so it does per tile only what
differs per tile: one f-string, no function call but for a user not seen before (or
a grey tile, which has no current reading), and a
count of the tile's whole percent, from which the header's GPUs per fullness bucket are
summed (no query of its own: the same buckets as ``/api/v1/fleet``, see
:func:`fullness`). What repeats is worked out once: the classes of each colour and
combination of flags (a table indexed by whole percent and flag mask), each user's
escaped name and initials."""

from __future__ import annotations

from html import escape as e
from urllib.parse import quote

from gpuwatch.server.fleet.schemas import FULL_BUCKET, FULLNESS_BUCKETS, UNKNOWN_BUCKET
from gpuwatch.server.web.charts import fullness_bar
from gpuwatch.server.web.format import size
from gpuwatch.server.web.templates.layout import Chrome, page
from gpuwatch.server.web.tiles import TILE_FLAGS, Fleet, FleetHost

# Open event kind -> tile class and the word its tooltip uses.
FLAGS = {
    "orphaned": ("o", "orphaned"),
    "idle": ("i", "idle holder"),
    "filling_up": ("f", "filling up"),
    "runaway": ("r", "runaway"),
    "gpu_lost": ("l", "lost"),
}
_BUCKET_CLASSES = (("0-25%", "c1"), ("25-50%", "c4"), ("50-75%", "c6"), ("75-90%", "c8"),
                   (FULL_BUCKET, "c9"), (UNKNOWN_BUCKET, "u"))  # fmt: skip


def fleet_page(chrome: Chrome, fleet: Fleet) -> str:
    root_hosts = e(chrome.root) + "/hosts/"
    # Each user's escaped name and initials, escaped once per user rather than per tile.
    users: dict[str | None, tuple[str, str, str]] = {}
    # GPUs with a current reading per whole percent used (the last: 100% or more).
    percents = [0] * 101
    hosts = [_host(host, root_hosts, users, percents) for host in fleet.hosts]
    body = [_summary(chrome, fleet, fullness(percents, fleet.gpus)), _controls()]
    body += ['<div class="fleet">', *hosts, "</div>"]
    if not fleet.hosts:
        body.append(
            '<p class="empty">No hosts yet. Create a token with <code>gpuwatch token create '
            "HOST</code> and start the agent with it.</p>"
        )
    return page(chrome, title="Fleet", active="fleet", body="".join(body))


def fullness(percents: list[int], gpus: int) -> dict[str, int]:
    """GPUs per bucket of ``/api/v1/fleet`` (fleet/service.py), from the tiles' counts
    per whole percent used: a bucket's bound is a whole percent, and for whole numbers
    ``used * 100 // total < bound`` exactly when ``used / total < bound / 100``. The
    GPUs without a current reading (silent host, lost, no figures) are the unknown."""
    out = {}
    low = 0
    for name, high in _BOUNDS:
        out[name] = sum(percents[low:high])
        low = high
    out[FULL_BUCKET] = sum(percents[low:])
    out[UNKNOWN_BUCKET] = gpus - sum(percents)
    return out


def _summary(chrome: Chrome, fleet: Fleet, fullness: dict[str, int]) -> str:
    counts = [(f"{name} full", fullness[name], css) for name, css in _BUCKET_CLASSES]
    legend = "".join(
        f'<span class="key"><i class="sw {css}"></i>{e(label)} <b>{count:,}</b></span>'
        for label, count, css in counts
    )
    flags = "".join(
        f'<span class="key"><i class="t {css} demo">{"✕" if css == "l" else ""}</i>{word} '
        f"<b>{fleet.flagged[kind]:,}</b></span>"
        for kind, (css, word) in FLAGS.items()
    )
    root = e(chrome.root)
    firing = (
        f'<a class="stat alert" href="{root}/alerts"><b>{chrome.firing}</b> firing alerts</a>'
        if chrome.firing
        else '<span class="stat"><b>0</b> firing alerts</span>'
    )
    return (
        '<section class="summary"><h1>Fleet</h1><div class="stats">'
        f'<span class="stat"><b>{len(fleet.hosts):,}</b> hosts</span>'
        f'<span class="stat"><b>{fleet.gpus:,}</b> GPUs</span>'
        f'<span class="stat{" warn" if fleet.silent_hosts else ""}"><b>{fleet.silent_hosts:,}</b>'
        " silent hosts</span>"
        f'<span class="stat"><b>{size(fleet.held_bytes["orphaned"])}</b> held by orphans</span>'
        f'<span class="stat"><b>{size(fleet.held_bytes["idle"])}</b> held idle</span>'
        f"{firing}</div>"
        f"{fullness_bar(counts, width=640)}"
        f'<div class="legend">{legend}</div><div class="legend">{flags}</div></section>'
    )


def _controls() -> str:
    return (
        '<div class="controls"><input type="search" id="hostfilter" placeholder="Filter hosts" '
        'aria-label="Filter hosts by name">'
        '<label><input type="checkbox" id="onlyflagged"> only hosts with flags</label></div>'
    )


def _host(
    host: FleetHost,
    root_hosts: str,
    users: dict[str | None, tuple[str, str, str]],
    percents: list[int],
) -> str:
    """A host's card and its tiles; each drawn tile's whole percent used is counted in
    ``percents`` (the header's fullness).

    A tile's figures travel as one compact attribute, ``data-v``: whole percent used
    ("-" when there is no current reading), used and total MiB, the largest holder's
    MiB, how many processes and users hold memory, and that holder's name (last: it may
    hold spaces). dashboard.js words them into the tile's tooltip when it is hovered or
    focused, which halved the page's bytes and the time to write them. Written with
    f-strings: in this loop, on Python 3.11, faster than ``%`` templates
    (bench/dashboard.py)."""
    name = e(host.hostname)
    href = root_hosts + e(quote(host.hostname, safe=""))
    gpus = href + "/gpus/"
    silent = host.silent
    tiles: list[str] = []
    append = tiles.append
    for _, index, total, used, user, largest, processes, count, mask in host.tiles:
        if silent or used is None or not total:  # used is None for a lost GPU too
            append(_stale(gpus, index, mask, user, largest, processes, count, users))
            continue
        percent = used * 100 // total
        whole = percent if percent < 100 else 100
        percents[whole] += 1
        css = _CLASSES[mask][whole]
        if processes:
            names = users.get(user) or _names(users, user)
            text = "✕" if mask & _LOST else names[2] if count > 1 else names[1]
            append(f'<a class="t {css}" href="{gpus}{index}" data-v="{percent} {used >> 20} {total >> 20} {(largest or 0) >> 20} {processes} {count} {names[0]}">{text}</a>')  # fmt: skip
        else:
            text = "✕" if mask & _LOST else ""
            append(f'<a class="t {css}" href="{gpus}{index}" data-v="{percent} {used >> 20} {total >> 20} 0 0 0 ">{text}</a>')  # fmt: skip
    css = "host flagged" if host.flagged else "host"
    badge = ' <span class="badge silent">silent</span>' if silent else ""
    return (
        f'<section class="{css}" data-h="{name}"><h2><a href="{href}">{name}</a>{badge}</h2>'
        f'<div class="tiles">{"".join(tiles) or "<span class=empty>no GPUs reported</span>"}'
        "</div></section>"
    )


def _stale(
    gpus: str,
    index: int,
    mask: int,
    user: str | None,
    largest: int | None,
    processes: int,
    count: int,
    users: dict[str | None, tuple[str, str, str]],
) -> str:
    """A tile without a current reading (silent host, lost GPU, no figures): grey, its
    holders as last known."""
    if processes:
        names = users.get(user) or _names(users, user)
        text = "✕" if mask & _LOST else names[2] if count > 1 else names[1]
        holder = f"{(largest or 0) >> 20} {processes} {count} {names[0]}"
    else:
        text, holder = "✕" if mask & _LOST else "", "0 0 0 "
    return (
        f'<a class="t u{_FLAG_CLASSES[mask]}" href="{gpus}{index}" data-v="- {holder}">{text}</a>'
    )


def _names(users: dict[str | None, tuple[str, str, str]], user: str | None) -> tuple[str, str, str]:
    """A user's escaped name and tile texts (initials; initials and "+" for a GPU that
    other users hold memory on too), remembered in ``users``."""
    name = user or "?"
    initials = e(name[:3])
    names = users[user] = (e(name), initials, initials + "+")
    return names


# What a tile says, worked out once rather than per tile: its flag classes per flag mask
# (see tiles.TILE_FLAGS), and with its colour (used/total in tenths) per flag mask and
# whole percent used.
_FLAG_CLASSES = [
    "".join(" " + FLAGS[kind][0] for bit, kind in enumerate(TILE_FLAGS) if mask & 1 << bit)
    for mask in range(1 << len(TILE_FLAGS))
]
_CLASSES = [
    [f"c{min(percent // 10, 9)}{flags}" for percent in range(101)] for flags in _FLAG_CLASSES
]
_LOST = 1 << TILE_FLAGS.index("gpu_lost")
# The buckets' upper bounds in whole percents (see :func:`fullness`).
_BOUNDS = [(name, round(bound * 100)) for name, bound in FULLNESS_BUCKETS]
assert all(abs(bound * 100 - round(bound * 100)) < 1e-9 for _, bound in FULLNESS_BUCKETS)
