"""The fleet page's markup and the script that draws its tiles: each host card carries
its tiles as ingest keeps them (``data-t``), and dashboard.js turns them into links
whose classes, ``data-v`` figures and text are checked here in headless chromium,
with a holder's name an agent sent staying text all the way."""

from __future__ import annotations

import json
import re
from html import unescape
from pathlib import Path

from selenium.webdriver.common.by import By

from gpuwatch.server.web.templates.fleet import fleet_page
from gpuwatch.server.web.templates.layout import STATIC, Chrome
from gpuwatch.server.web.tiles import TILE_FLAGS, Fleet, FleetHost
from web.browser import Browser

STATIC_DIR = Path(__file__).resolve().parents[2] / "gpuwatch/server/web/static"
HOSTILE = "mal<b>\"ory</b> & co'"
IDLE, LOST = (1 << TILE_FLAGS.index(kind) for kind in ("idle", "gpu_lost"))
# index, percent, used MiB, total MiB, largest MiB, processes, users, user, flags
TILES = [
    [0, 62, 51205, 81920, 30720, 3, 2, HOSTILE, IDLE],
    [1, 0, 0, 81920, 0, 0, 0, None, 0],
    [2, None, None, 81920, 4096, 1, 1, "bob", LOST],  # lost: no current reading
    [3, 130, 106496, 81920, 106496, 1, 1, None, 0],  # over 100%, an unknown owner
]


def fleet_of(*hosts: FleetHost) -> Fleet:
    return Fleet(
        hosts=list(hosts),
        fullness={"0-25%": 1, "25-50%": 0, "50-75%": 1, "75-90%": 0, "90-100%": 1, "unknown": 1},
        held_bytes={"orphaned": 0, "idle": 0},
        flagged=dict.fromkeys(TILE_FLAGS, 0),
        silent_hosts=sum(host.silent for host in hosts),
    )


def page_of(*hosts: FleetHost) -> str:
    return fleet_page(Chrome(root="/gw", now=0.0, firing=0, sign_out=False), fleet_of(*hosts))


def drawn(browser: Browser, html: str, tmp_path: Path) -> list[tuple[str, str, str, str, str]]:
    """Each tile the script draws on ``html`` (loaded from a file, with the server's
    own stylesheet and script): its host, classes, link, data-v (unescaped) and text."""
    page = tmp_path / "fleet.html"
    page.write_text(html.replace(f"/gw{STATIC}/", STATIC_DIR.as_uri() + "/"))
    browser.open(page.as_uri())
    assert browser.console_errors() == []
    return [
        (
            tile.find_element(By.XPATH, "ancestor::section").get_attribute("data-h"),
            tile.get_attribute("class"),
            tile.get_attribute("href").removeprefix("file://"),
            tile.get_attribute("data-v"),
            tile.text,
        )
        for tile in browser.driver.find_elements(By.CSS_SELECTOR, ".fleet a.t")
    ]


def test_a_host_card_carries_its_tiles_as_text(tmp_path: Path) -> None:
    text = json.dumps(TILES)
    html = page_of(FleetHost("h/1", False, text), FleetHost("empty", False, "[]"))
    cards = dict(re.findall(r'<section class="host" data-h="([^"]+)"( data-t="[^"]*")?', html))
    assert unescape(cards["h/1"].removeprefix(' data-t="')[:-1]) == text
    assert cards["empty"] == "" and "no GPUs reported" in html
    assert "<b>" not in html.split('<div class="fleet"')[1]  # the name stays text
    order = re.search(r'<div class="fleet" data-flags="([^"]+)"', html)
    assert order and order.group(1) == "o i f r l"  # the bits of a tile's flag mask


def test_the_script_draws_each_tile_from_its_figures(browser: Browser, tmp_path: Path) -> None:
    html = page_of(FleetHost("h/1", False, json.dumps(TILES)), FleetHost("quiet", True, "[]"))
    busy, empty, lost, over = drawn(browser, html, tmp_path)
    # 62% used (class c6), 51205 of 81920 MiB; the holder's 30 GiB, 3 processes, 2 users.
    assert busy == (
        "h/1",
        "t c6 i",
        "/gw/hosts/h%2F1/gpus/0",
        f"62 51205 81920 30720 3 2 {HOSTILE}",
        "mal+",
    )
    assert empty == ("h/1", "t c0", "/gw/hosts/h%2F1/gpus/1", "0 0 81920 0 0 0 ", "")
    assert lost == ("h/1", "t u l", "/gw/hosts/h%2F1/gpus/2", "- 4096 1 1 bob", "✕")
    assert over == ("h/1", "t c9", "/gw/hosts/h%2F1/gpus/3", "130 106496 81920 106496 1 1 ?", "?")
    card = browser.driver.find_element(By.CSS_SELECTOR, 'section[data-h="h/1"]')
    assert "flagged" in card.get_attribute("class").split()  # an open flag on a tile
    assert "<b>" not in browser.driver.find_element(By.CLASS_NAME, "fleet").get_attribute(
        "innerHTML"
    ).replace("&lt;b&gt;", "")


def test_a_silent_hosts_tiles_are_grey_with_their_holders_as_last_known(
    browser: Browser, tmp_path: Path
) -> None:
    html = page_of(FleetHost("gone", True, json.dumps(TILES[:2])))
    held, empty = drawn(browser, html, tmp_path)
    assert held[1:] == ("t u i", "/gw/hosts/gone/gpus/0", f"- 30720 3 2 {HOSTILE}", "mal+")
    assert empty[1:] == ("t u", "/gw/hosts/gone/gpus/1", "- 0 0 0 ", "")
    assert "silent" in browser.driver.find_element(By.CSS_SELECTOR, "section.host").text


def test_a_tile_tells_numbered_users_apart_and_shows_an_override_as_an_escape(
    browser: Browser, tmp_path: Path
) -> None:
    """Users user0 .. user36 all read "use" on their tiles; a holder or host name with
    a direction override was drawn reversed, in the tile and in its tooltip."""
    users = ["user0", "user36", "\u202eevil", "bob"]
    tiles = [[i, 50, 40960, 81920, 4096, 1, 1, user, 0] for i, user in enumerate(users)]
    html = page_of(FleetHost("rtl-\u202ehost", False, json.dumps(tiles)))
    drawn_tiles = drawn(browser, html, tmp_path)
    assert [text for *_, text in drawn_tiles] == ["us0", "u36", "\\u2", "bob"]
    assert drawn_tiles[2][3].endswith(" \\u202eevil")  # the tooltip's figures
    heading = browser.driver.find_element(By.CSS_SELECTOR, "section.host h2 bdi")
    assert heading.get_attribute("textContent") == "rtl-\\u202ehost"
