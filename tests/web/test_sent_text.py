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
from pathlib import Path
from urllib.parse import quote

import pytest
from selenium.webdriver.common.by import By
from server.factories import body, gpu, process, snapshot
from server.harness import make_token

from gpuwatch.snapshot import ProcessOwner
from web.browser import Browser
from web.conftest import Site, running_site
from web.test_pages import assert_clean

RLO = "\u202e"
BIDI_HOST = "bidi-host"
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
        wide = process(4343, used_gib=3, orphaned=True).model_copy(
            update={"owner": ProcessOwner(user=WIDE_USER, uid=1002, container_id=CONTAINER)}
        )
        hosts = {
            BIDI_HOST: [gpu(0, [], uuid=f"GPU-{RLO}0a1b2c", lost=True), gpu(1, [bidi])],
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


def test_the_host_and_gpu_pages_escape_overrides_in_what_they_show(sent_site: Site) -> None:
    """A value alone in its element (a name, a job id, a command) keeps its override,
    isolated (``<bdi>``, ``<code>``); tooltips, which nothing isolates, and text around
    such values show it as an escape."""
    for path in (f"/hosts/{BIDI_HOST}", f"/hosts/{BIDI_HOST}/gpus/1", "/alerts"):
        page = sent_site.client.get(path).text
        main = page[page.index("<main>") :]
        titles = re.findall(r'title="([^"]*)"|<title>([^<]*)</title>', main)
        assert all(RLO not in "".join(t) for t in titles), path
        loose = re.sub(r"<(bdi|code)\b[^>]*>[^<]*</\1>", "", main)
        assert RLO not in loose, path


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
