"""Text built around values an agent sent cannot reorder the page, nor widen it.

The audit's payloads: a Slurm job id ending in a right-to-left override (U+202E), a
GPU UUID holding one, and an OOM summary holding one. Chromium rendered the event
summaries reversed after the override ("... 77BiG 0.5 sdloh dna ..."): who holds how
much read backwards. A 256-character user and a 64-character container id made the
processes table 2,638 px wide in a 1,440 px window.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from html import unescape
from pathlib import Path
from urllib.parse import quote

import pytest
from selenium.webdriver.common.by import By
from server.factories import GIB, body, gpu, process, snapshot
from server.harness import make_token

from gpuwatch.server.alerts.rules import describe
from gpuwatch.server.alerts.schemas import AlertOut, CulpritOut
from gpuwatch.server.notifications.model import Culprit
from gpuwatch.server.web.templates.alerts import alerts_page
from gpuwatch.server.web.templates.layout import COMMAND_CHARS, Chrome, command_text
from gpuwatch.snapshot import ProcessOwner
from gpuwatch.terminal_text import printable
from web.browser import Browser
from web.conftest import Site, running_site
from web.test_pages import assert_clean

RLO = "\u202e"
ESC = "\x1b"
BIDI_HOST = "bidi-host"
# What the audit pushed: drawn as is, the override made the command read "… txt.exe".
SPOOFED = f'"><img src=x>{RLO}exe.txt {ESC}[2J' + "A" * 3000
WIDE_HOST = "w" * 250
WIDE_USER = "x" * 256
CONTAINER = "c0ffee" * 10 + "abcd"


@pytest.fixture(scope="module")
def sent_site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    with running_site(tmp_path_factory.mktemp("sent")) as site:
        now = site.clock()
        bidi = process(4242, used_gib=5, orphaned=True).model_copy(
            update={"owner": ProcessOwner(user="mallory", uid=1001, slurm_job_id=f"77{RLO}")}
        )
        spoofed = process(4545, used_gib=2, user=f"mal{RLO}lory").model_copy(
            update={"command": SPOOFED}
        )
        wide = process(4343, used_gib=3, orphaned=True).model_copy(
            update={"owner": ProcessOwner(user=WIDE_USER, uid=1002, container_id=CONTAINER)}
        )
        hosts = {
            BIDI_HOST: [gpu(0, [], uuid=f"GPU-{RLO}0a1b2c", lost=True), gpu(1, [bidi, spoofed])],
            WIDE_HOST: [gpu(0, [wide, process(4344, user="alice")])],
        }
        for name, gpus in hosts.items():
            token = make_token(site.database, name, now)
            headers = {"Authorization": f"Bearer {token}"}
            snap = snapshot(0, gpus, hostname=name, at=now)
            assert site.client.post("/api/v1/snapshots", json=body(snap), headers=headers)
        oom = {"kind": "oom", "hostname": BIDI_HOST, "gpu_index": 1, "pid": 4242,
               "summary": f"CUDA out of memory in job 77{RLO} while it holds 5.0 GiB",
               "evidence": {}, "occurred_at": now - 30}  # fmt: skip
        headers = {"Authorization": f"Bearer {make_token(site.database, BIDI_HOST, now)}"}
        assert site.client.post("/api/v1/events", json=oom, headers=headers).status_code == 200
        yield site


# The left edge, on screen, of the first occurrence of ``arguments[1]`` in the text of
# element ``arguments[0]``.
LEFT_OF = """
var walker = document.createTreeWalker(arguments[0], NodeFilter.SHOW_TEXT);
for (var node = walker.nextNode(); node; node = walker.nextNode()) {
  var at = node.data.indexOf(arguments[1]);
  if (at < 0) continue;
  var range = document.createRange();
  range.setStart(node, at);
  range.setEnd(node, at + arguments[1].length);
  return range.getBoundingClientRect().left;
}
return null;
"""


def test_an_override_in_a_summary_cannot_reverse_the_words_after_it(
    sent_site: Site, browser: Browser, tmp_path: Path
) -> None:
    browser.open(f"{sent_site.url}/events?host={BIDI_HOST}")
    rows = browser.driver.find_elements(By.CSS_SELECTOR, "table.events tbody tr")
    summaries = {r.find_element(By.CSS_SELECTOR, "td:last-child") for r in rows}
    texts = [s.get_attribute("textContent") for s in summaries]
    assert any("77\\u202e lost its parent" in t for t in texts), texts  # orphaned
    assert any("GPU-\\u202e0a1b2c" in t for t in texts), texts  # gpu_lost
    assert all(RLO not in t for t in texts)
    (oom,) = [s for s in summaries if "while it holds" in s.get_attribute("textContent")]
    # As written, left to right: "holds" before "5.0" before "GiB".
    lefts = [browser.js(LEFT_OF, oom, word) for word in ("while", "holds", "5.0", "GiB")]
    assert None not in lefts and lefts == sorted(lefts), lefts
    # The chart's tooltips (SVG titles) show the override as an escape too.
    titles = browser.js(
        "return Array.from(document.querySelectorAll('svg title'), t => t.textContent)"
    )
    assert titles and all(RLO not in t for t in titles)
    assert_clean(browser, sent_site)
    browser.screenshot("dashboard-bidi-summaries", tmp_path)


@pytest.mark.parametrize(
    "path", [f"/hosts/{BIDI_HOST}", f"/hosts/{BIDI_HOST}/gpus/1", f"/events?host={BIDI_HOST}"]
)
def test_no_page_shows_an_override_or_a_control_character_as_is(path: str, sent_site: Site) -> None:
    """Not in a value alone in its element either (a name, a job id, a GPU UUID, a
    command): isolated or not, an override reverses the value itself (the audit's
    command read "… txt.exe"), and a raw ESC is not valid HTML text. Each is shown as
    an escape, as the tooltips show it."""
    page = sent_site.client.get(path).text
    assert RLO not in page and ESC not in page
    assert "\\u202e" in page


def test_a_command_is_shown_escaped_isolated_and_cut_with_the_whole_in_its_tooltip(
    sent_site: Site,
) -> None:
    for path in (f"/hosts/{BIDI_HOST}", f"/hosts/{BIDI_HOST}/gpus/1"):
        page = sent_site.client.get(path).text
        (title, shown) = re.findall(
            r'<code title="(&quot;&gt;&lt;img[^"]*)"><bdi>([^<]*)</bdi>', page
        )[:1][0]
        assert unescape(title) == printable(SPOOFED)  # whole, with the escapes
        assert unescape(shown) == printable(SPOOFED)[: COMMAND_CHARS - 1] + "…"
        assert "<img" not in page


@pytest.mark.parametrize(
    "path",
    [
        f"/hosts/{quote(WIDE_HOST)}",
        f"/hosts/{quote(WIDE_HOST)}/gpus/0",
        f"/events?host={WIDE_HOST}",
    ],
)
def test_a_long_user_or_container_id_keeps_the_page_in_the_window(
    path: str, sent_site: Site, browser: Browser, tmp_path: Path
) -> None:
    browser.open(sent_site.url + path)
    assert browser.js(
        "return document.documentElement.scrollWidth <= document.documentElement.clientWidth"
    )
    cut = browser.driver.find_elements(By.CSS_SELECTOR, "td bdi.cut")
    whole = {c.get_attribute("title") for c in cut}
    assert WIDE_USER in whole  # the full value, in the title
    if "events" not in path:
        assert CONTAINER in whole
        # The job column is as wide as the user column, not one character a line.
        table = browser.driver.find_element(By.CSS_SELECTOR, "table.processes")
        assert table.size["width"] <= browser.js("return window.innerWidth")
        row = next(c for c in cut if c.get_attribute("title") == CONTAINER)
        assert row.size["height"] < 40
    assert_clean(browser, sent_site)
    browser.screenshot(f"dashboard-wide-{path.split('/')[1][:6]}", tmp_path)


def test_the_alerts_page_cuts_a_culprits_command_as_the_host_page_does() -> None:
    """The audit's runaway alert: its description held the whole 3,000-character
    command (one row filled screens) and its culprit cell the override as is."""
    spoofer = Culprit(pid=4545, user=f"mal{RLO}lory", command=SPOOFED, memory_bytes=2 * GIB)
    other = Culprit(pid=4546, user="bob", command="python a.py", memory_bytes=GIB)
    alert = AlertOut(
        id=1,
        rule="runaway_process",
        state="firing",
        severity="warning",
        labels={"rule": "runaway_process", "hostname": BIDI_HOST, "gpu": "1"},
        summary=f"runaway on {BIDI_HOST} GPU 1",
        description="\n".join(describe(c) for c in (spoofer, other)),
        culprits=[CulpritOut(**vars(c)) for c in (spoofer, other)],
        active_since=0.0,
        starts_at=0.0,
        ends_at=None,
        silenced_by=[],
    )
    page = alerts_page(Chrome(root="", now=60.0, firing=1, sign_out=False), [alert], [], [])
    assert RLO not in page and ESC not in page and "<img" not in page
    description = re.search(r'<div class="muted">(.*?)</div>', page)
    assert description is not None
    lines = [unescape(re.sub("<[^>]+>", "", line)) for line in description[1].split("<br>")]
    # A line per culprit, each with its command cut.
    assert len(lines) == 2 and lines[1] == "bob's pid 4546 (python a.py) holds 1.0 GiB"
    assert "\\u202eexe.txt" in lines[0] and len(lines[0]) < 200
    # The culprit cell shows the command as the host page does, whole in its tooltip.
    assert command_text(SPOOFED) in page
