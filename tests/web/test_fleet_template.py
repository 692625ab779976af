"""The fleet page's tiles as markup: what a tile's ``data-v`` carries for the script's
tooltip, and that a name an agent sent stays text there."""

from __future__ import annotations

import re
from html import unescape

from gpuwatch.server.fleet.schemas import FULL_BUCKET, FULLNESS_BUCKETS, UNKNOWN_BUCKET
from gpuwatch.server.web.templates.fleet import fleet_page
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
            ("h/1", 0.0, 0, 80 * GIB, 50 * GIB + 5 * MIB, False, HOSTILE, 30 * GIB, 3, 2),
            ("h/1", 0.0, 1, 80 * GIB, 0, False, None, None, None, None),
            ("h/1", 0.0, 2, 80 * GIB, None, True, "bob", 4 * GIB, 1, 1),
        ],
        masks={0: idle},
        flagged=True,
    )
    buckets = [name for name, _ in FULLNESS_BUCKETS] + [FULL_BUCKET, UNKNOWN_BUCKET]
    fleet = Fleet(
        hosts=[host],
        gpus=3,
        fullness=dict.fromkeys(buckets, 1),
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
