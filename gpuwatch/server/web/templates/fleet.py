"""The fleet page: every GPU as a tile, coloured by fullness, grouped by host.

A tile's colour is its used/total in tenths (grey when its reading is stale or lost);
its text is the owner of its largest process ("+" when other users hold some too);
corner marks and borders flag open events (orphaned, idle, filling up, runaway). It
links to the GPU's page, and its tooltip (worded on hover or focus from the tile's
``data-v`` figures) has the memory, the holders and the flags in words.

The server writes the header and one card per host carrying the host's tiles as
ingest keeps them (``data-t``: gpuwatch/server/hosts/tiles.py); the page's script
draws the tiles from them (static/dashboard.js), so nothing here runs per GPU. The
header's GPUs per fullness bucket are ``/api/v1/fleet``'s own.
"""

from __future__ import annotations

from html import escape as e

from gpuwatch.server.fleet.schemas import FULL_BUCKET, UNKNOWN_BUCKET
from gpuwatch.server.web.charts import fullness_bar
from gpuwatch.server.web.format import gpus_prefix, host_path, size
from gpuwatch.server.web.templates.layout import Chrome, page, text
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
    hosts = [_host(host, chrome.root) for host in fleet.hosts]
    body = [_summary(chrome, fleet), _controls()]
    # The flag classes in the order of a tile's flag mask bits, for the script.
    flags = " ".join(FLAGS[kind][0] for kind in TILE_FLAGS)
    body += [f'<div class="fleet" data-flags="{flags}">', _NOSCRIPT, *hosts, "</div>"]
    if not fleet.hosts:
        body.append(
            '<p class="empty">No hosts yet. Create a token with <code>gpuwatch token create '
            "HOST</code> and start the agent with it.</p>"
        )
    return page(chrome, title="Fleet", active="fleet", body="".join(body))


def _summary(chrome: Chrome, fleet: Fleet) -> str:
    counts = [
        (name if name == UNKNOWN_BUCKET else f"{name} full", fleet.fullness[name], css)
        for name, css in _BUCKET_CLASSES
    ]
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


def _host(host: FleetHost, root: str) -> str:
    """A host's card: its name, and its tiles as ingest keeps them (hosts/tiles.py),
    which the script draws, linking each to ``data-g`` and the GPU's index; a silent
    host's tiles are grey."""
    name = e(host.hostname)
    href = host_path(root, host.hostname)
    if host.silent:
        css, badge = "host flagged silent", ' <span class="badge silent">silent</span>'
    else:
        css, badge = "host", ""
    if host.tiles is None or host.tiles == "[]":
        tiles, data = "<span class=empty>no GPUs reported</span>", ""
    else:
        tiles = ""
        data = f' data-t="{e(host.tiles)}" data-g="{gpus_prefix(root, host.hostname)}"'
    return (
        f'<section class="{css}" data-h="{name}"{data}><h2><a href="{href}">{text(host.hostname)}'
        f'</a>{badge}</h2><div class="tiles">{tiles}</div></section>'
    )


_NOSCRIPT = (
    '<noscript><p class="empty">The tiles are drawn by this page\'s script: allow it, or'
    " open a host for its GPUs.</p></noscript>"
)
