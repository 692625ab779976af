"""The fleet page: every GPU as a tile, coloured by fullness, grouped by host.

A tile's colour is its used/total in tenths (grey when its reading is stale or lost);
its text is the owner of its largest process ("+" when other users hold some too); corner marks and borders flag open events
(orphaned, idle, filling up, runaway). Its tooltip has the figures, and it links to
the GPU's page. At 8,000 GPUs this loop is most of the page's cost, so it formats
with ``%`` (measured faster than f-strings and ``format`` here, hence the ``noqa``) and
caches what repeats (escaped names, flag classes).
"""

from __future__ import annotations

from html import escape as e
from urllib.parse import quote

from gpuwatch.server.fleet.schemas import FULL_BUCKET, UNKNOWN_BUCKET
from gpuwatch.server.web.charts import fullness_bar
from gpuwatch.server.web.format import size
from gpuwatch.server.web.service import Fleet, FleetHost
from gpuwatch.server.web.templates.layout import Chrome, page

GIB = 2**30
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
    body = [_summary(chrome, fleet), _controls(), '<div class="fleet">']
    root_hosts = e(chrome.root) + "/hosts/"
    # What repeats across tiles, formatted once: the classes and words of each set of
    # flags, each user's escaped name and initials.
    cache: dict[object, tuple[str, str]] = {}
    for host in fleet.hosts:
        body.append(_host(host, root_hosts, fleet, cache))
    body.append("</div>")
    if not fleet.hosts:
        body.append(
            '<p class="empty">No hosts yet. Create a token with <code>gpuwatch token create '
            "HOST</code> and start the agent with it.</p>"
        )
    return page(chrome, title="Fleet", active="fleet", body="".join(body))


def _summary(chrome: Chrome, fleet: Fleet) -> str:
    counts = [(f"{name} full", fleet.fullness[name], css) for name, css in _BUCKET_CLASSES]
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
    host: FleetHost, root_hosts: str, fleet: Fleet, cache: dict[object, tuple[str, str]]
) -> str:
    name = e(host.hostname)
    href = root_hosts + e(quote(host.hostname, safe=""))
    flagged = bool(host.host_flags) or host.silent
    tiles = []
    no_flags: frozenset[str] = frozenset()
    for index, total, used, lost, user, largest, processes, users in host.tiles:
        flags = fleet.flags.get((host.hostname, index), no_flags)
        if flags:
            flagged = True
        parts = cache.get(flags)
        if parts is None:
            parts = cache[flags] = _flag_parts(flags)
        if host.silent or lost or used is None or not total:
            css, figures = "u", "no current reading"
        else:
            tenth = used * 10 // total
            css = "c%d" % (tenth if tenth < 9 else 9)  # noqa: UP031
            figures = "%.1f of %.1f GiB (%d%%)" % (used / GIB, total / GIB, used * 100 // total)  # noqa: UP031
        if "gpu_lost" in flags:
            text, who = "✕", "fallen off the bus"
        elif processes:
            names = cache.get(user)
            if names is None:
                names = cache[user] = (e(user or "?"), e((user or "?")[:3]))
            text = names[1] + ("+" if users > 1 else "")
            who = "largest: %s %.1f GiB · %d processes, %d users" % (  # noqa: UP031
                names[0],
                (largest or 0) / GIB,
                processes,
                users,
            )
        else:
            text, who = "", "no processes"
        tiles.append(
            '<a class="t %s%s" href="%s/gpus/%d" title="GPU %d: %s&#10;%s%s">%s</a>'  # noqa: UP031
            % (css, parts[0], href, index, index, figures, who, parts[1], text)
        )
    css = "host flagged" if flagged else "host"
    badge = ' <span class="badge silent">silent</span>' if host.silent else ""
    return (
        f'<section class="{css}" data-h="{name}"><h2><a href="{href}">{name}</a>{badge}</h2>'
        f'<div class="tiles">{"".join(tiles) or "<span class=empty>no GPUs reported</span>"}'
        "</div></section>"
    )


def _flag_parts(flags: frozenset[str]) -> tuple[str, str]:
    """The tile's extra classes and its tooltip line for a set of open event kinds."""
    known = [kind for kind in FLAGS if kind in flags]
    classes = "".join(" " + FLAGS[kind][0] for kind in known)
    words = ", ".join(FLAGS[kind][1] for kind in known)
    return classes, ("&#10;" + words if words else "")
