"""The fleet page's tiles as markup: what a tile's ``data-v`` carries for the script's
tooltip, that a name an agent sent stays text there, and how the header sums the
tiles into fullness buckets."""

from __future__ import annotations

import re
from html import unescape

from gpuwatch.server.web.templates.fleet import fleet_page, fullness
from gpuwatch.server.web.templates.layout import Chrome
from gpuwatch.server.web.tiles import TILE_FLAGS, Fleet, FleetHost

GIB = 2**30
MIB = 2**20
HOSTILE = 'mal<b>"ory</b> & co'


def tiles_of(html: str) -> list[tuple[str, str, str, str]]:
    """Each tile's classes, link, data-v (unescaped) and text."""
    found = re.findall(r'<a class="(t [^"]*)" href="([^"]*)" data-v="([^"]*)">([^<]*)</a>', html)
    return [(css, href, unescape(data), unescape(text)) for css, href, data, text in found]


def test_a_tile_carries_its_figures_and_an_escaped_holder() -> None:
    idle = 1 << TILE_FLAGS.index("idle")
    host = FleetHost(
        hostname="h/1",
        silent=False,
        tiles=[
            (1, 0, 80 * GIB, 50 * GIB + 5 * MIB, HOSTILE, 30 * GIB, 3, 2, idle),
            (1, 1, 80 * GIB, 0, None, None, 0, 0, 0),
            (1, 2, 80 * GIB, None, "bob", 4 * GIB, 1, 1, 0),  # lost: no current reading
        ],
        flagged=True,
    )
    fleet = Fleet(
        hosts=[host],
        gpus=3,
        held_bytes={"orphaned": 0, "idle": 0},
        flagged=dict.fromkeys(TILE_FLAGS, 0),
        silent_hosts=0,
    )
    page = fleet_page(Chrome(root="/gw", now=0.0, firing=0, sign_out=False), fleet)
    assert "<b>" not in page.split('<div class="fleet">')[1]  # the name stays text
    busy, empty, lost = tiles_of(page)
    # 62% used (class c6), 51205 of 81920 MiB; the holder's 30 GiB, 3 processes, 2 users.
    assert busy == (
        "t c6 i",
        "/gw/hosts/h%2F1/gpus/0",
        f"62 51205 81920 30720 3 2 {HOSTILE}",
        "mal+",
    )
    assert empty == ("t c0", "/gw/hosts/h%2F1/gpus/1", "0 0 81920 0 0 0 ", "")
    assert lost == ("t u", "/gw/hosts/h%2F1/gpus/2", "- 4096 1 1 bob", "bob")


def test_the_header_buckets_whole_percents_as_the_fleet_api_does() -> None:
    # The API buckets used/total against 0.25, 0.5, 0.75 and 0.9; the page counts whole
    # percents (what its tiles show) and sums them: 25% is in 25-50%, 89% in 75-90%,
    # 90% and anything over 100% in 90-100%; GPUs it drew grey are unknown.
    percents = [0] * 101
    for whole in (0, 24, 25, 49, 50, 74, 75, 89, 90, 99, 100):
        percents[whole] += 1
    assert fullness(percents, gpus=13) == {
        "0-25%": 2,
        "25-50%": 2,
        "50-75%": 2,
        "75-90%": 2,
        "90-100%": 3,
        "unknown": 2,
    }
