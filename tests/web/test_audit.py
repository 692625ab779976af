"""What an audit of the dashboard found, each now held by a test:

* a hostname holding "/" (agents may send any text) had host and GPU pages that
  answered 404 although the fleet linked to them;
* a lost GPU and a silent host's GPUs showed their last figures (and their processes
  "holding memory now") as if current; the fleet tooltip of a silent host's tile named
  its last holder as the current one;
* a long name (256 characters, one word) pushed the host page wider than the window,
  and right-to-left text or a stray direction override in a name could reorder the
  text after it;
* hostile query values (too long, not a number, an unknown state, a range that ends
  before it starts, a GPU index that is not one) were a JSON 422 instead of a message
  on the page (a NUL stays a 422, as on every parameter: tests/server/test_hostile.py);
* the login form was shown to a user already signed in, instead of the page asked for;
* text on the idle and runaway badges and on the 75-90% tile had a contrast under 4.5:1;
* the host page spent most of its time writing every chart column of every process,
  even of a process that held memory for a minute of the range.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import httpx
import pytest
from selenium.webdriver.common.action_chains import ActionChains
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait
from server.factories import body, gpu, process, snapshot
from server.harness import make_token

from gpuwatch.server.web.charts import memory_chart
from gpuwatch.server.web.service import History, Layer
from gpuwatch.terminal_text import printable
from web.browser import Browser
from web.conftest import READ_TOKEN, Site, running_site
from web.test_pages import assert_clean

SLASHED = 'a/b?c#d%2F..<i>"x"</i>'
RTL = "\u05e9\u05e8\u05ea-\u202egpu-rtl"  # Hebrew, then an override never closed
LONG = "x" * 250
HOSTILE = [SLASHED, RTL, LONG, "ctl\x01\x07\x1b[31m\x7f-host", "h\u00e9llo-\u6f22\u5b57"]


@pytest.fixture(scope="module")
def hostile_site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    """The scenario fleet, plus hosts whose names, users and commands are hostile."""
    with running_site(tmp_path_factory.mktemp("hostile")) as site:
        for i, name in enumerate(HOSTILE):
            token = make_token(site.database, name, site.clock())
            holder = process(7000 + i, used_gib=3, user=HOSTILE[(i + 1) % len(HOSTILE)][:64])
            holder = holder.model_copy(update={"command": name * 8})
            snap = snapshot(0, [gpu(0, [holder]), gpu(1, [])], hostname=name, at=site.clock())
            response = site.client.post(
                "/api/v1/snapshots", json=body(snap), headers={"Authorization": f"Bearer {token}"}
            )
            assert response.status_code == 200, response.text
        yield site


def test_every_link_of_the_fleet_page_answers_even_for_a_name_with_a_slash(
    hostile_site: Site,
) -> None:
    fleet = hostile_site.client.get("/")
    links = {h.replace("&amp;", "&") for h in re.findall(r'href="(/hosts/[^"]+)"', fleet.text)}
    assert f"/hosts/{quote(SLASHED, safe='')}" in links
    for name in HOSTILE:
        for link in (f"/hosts/{quote(name, safe='')}", f"/hosts/{quote(name, safe='')}/gpus/0"):
            links.add(link)
            links.add(link + "?range=1h")
    answers = {link: hostile_site.client.get(link).status_code for link in sorted(links)}
    assert set(answers.values()) == {200}, {k: v for k, v in answers.items() if v != 200}
    page = hostile_site.client.get(f"/hosts/{quote(SLASHED, safe='')}/gpus/0")
    assert "&lt;i&gt;&quot;x&quot;&lt;/i&gt;" in page.text and "<i>" not in page.text
    # An unknown GPU on that host is the not-found page, not the host page.
    missing = hostile_site.client.get(f"/hosts/{quote(SLASHED, safe='')}/gpus/7")
    assert missing.status_code == 404 and "No GPU" in missing.text


@pytest.mark.parametrize("name", [RTL, LONG, SLASHED])
def test_a_hostile_name_stays_text_in_its_own_box_and_fits_the_window(
    name: str, hostile_site: Site, browser: Browser, tmp_path: Path
) -> None:
    browser.open(f"{hostile_site.url}/hosts/{quote(name, safe='')}/gpus/0")
    heading = browser.driver.find_element(By.TAG_NAME, "h1")
    # The name is isolated, so right-to-left text in it cannot turn " · GPU 0" around,
    # and an override in it is shown as an escape, so it cannot turn the name around.
    isolated = heading.find_element(By.TAG_NAME, "bdi")
    assert isolated.get_attribute("textContent") == printable(name)
    assert browser.js("return document.querySelectorAll('main i, main img').length") == 0
    assert browser.js(
        "return document.documentElement.scrollWidth <= document.documentElement.clientWidth"
    )
    assert_clean(browser, hostile_site)
    browser.screenshot(f"dashboard-hostile-{len(name)}", tmp_path)


def test_a_lost_gpu_and_a_silent_host_show_no_current_reading(site: Site) -> None:
    host, lost = site.fleet.lost
    page = site.client.get(f"/hosts/{host}").text
    cards = re.findall(r'<section class="card gpu">.*?</section>', page, re.S)
    lost_card = next(c for c in cards if f'/gpus/{lost}"' in c)
    assert "no current reading: GPU lost" in lost_card and "last known:" in lost_card
    assert all("no current reading" not in c for c in cards if c is not lost_card)
    # Its process (alice's 40 GiB) is flagged as seen before the loss, not current.
    row = next(r for r in re.findall(r"<tr>.*?</tr>", page, re.S) if ">401<" in r)
    assert "GPU lost: seen" in row
    silent = site.client.get(f"/hosts/{site.fleet.silent_host}").text
    assert "no current reading: host silent" in silent
    assert "Processes at the last report (30 min ago)" in silent
    assert "Processes holding memory now" not in silent
    # gina's process held memory for the 2¾ minutes it was seen, not the 40 until now.
    row = next(r for r in re.findall(r"<tr>.*?</tr>", silent, re.S) if ">501<" in r)
    assert "host silent: seen 37 min ago" in row
    assert ">2 min</span>" in row and "40 min" not in row
    gpu_page = site.client.get(f"/hosts/{site.fleet.silent_host}/gpus/0").text
    assert "no current reading: host silent" in gpu_page


def test_a_silent_hosts_tile_names_its_holder_as_last_known(site: Site, browser: Browser) -> None:
    browser.open(site.url + "/")
    tile = browser.driver.find_element(
        By.CSS_SELECTOR, f'section.host[data-h="{site.fleet.silent_host}"] a.t'
    )
    ActionChains(browser.driver).move_to_element(tile).perform()
    assert tile.get_attribute("title").splitlines() == [
        "GPU 0: no current reading (host silent)",
        "at the last report: largest: gina 5.0 GiB · 1 process, 1 user",
    ]
    legend = browser.driver.find_element(By.CSS_SELECTOR, ".summary").text
    assert "\nunknown\n2\n" in legend  # the lost GPU and the silent host's
    assert "unknown full" not in legend
    assert_clean(browser, site)


@pytest.mark.parametrize(
    ("query", "message"),
    [
        ("gpu=-1", "is not a GPU index"),
        ("gpu=99999999999999999999", "is not a GPU index"),
        ("gpu=%E2%91%A0", "is not a GPU index"),
        ("host=" + "a" * 300, "longer than 256 characters"),
        ("user=" + "u" * 300, "longer than 256 characters"),
        ("state=%3Cscript%3E", "state"),
        ("kind=" + "k" * 100, "unknown kind"),
        ("since=2027-01-15T09:00&until=2027-01-15T08:00", "ends before it starts"),
        ("since=" + "9" * 100, "not a time"),
        ("cursor=" + "A" * 300, "invalid cursor"),
    ],
)
def test_a_hostile_events_query_is_reported_on_the_page(
    site: Site, query: str, message: str
) -> None:
    page = site.client.get(f"/events?{query}")
    assert page.status_code == 200, page.text[:300]
    error = re.search(r'<p class="error">([^<]*)</p>', page.text)
    assert error is not None and error.group(1).startswith("Ignored a filter")
    assert message in error.group(1)
    assert "<script>" not in page.text
    assert "<table" in page.text  # the events are still listed, unfiltered


@pytest.mark.parametrize(
    "path",
    ["/hosts/gpu-a/gpus/abc", "/hosts/gpu-a/gpus/5000", "/hosts/gpu-a/gpus/%D9%A3",
     "/hosts/" + "a" * 300, "/hosts/gpu-a/gpus/-1"],
)  # fmt: skip
def test_a_detail_url_that_names_nothing_is_the_not_found_page(site: Site, path: str) -> None:
    response = site.client.get(path)
    assert response.status_code == 404
    assert response.headers["content-type"].startswith("text/html")
    assert "<h1>Not found</h1>" in response.text


def test_a_junk_range_falls_back_to_the_default(site: Site) -> None:
    response = site.client.get("/hosts/gpu-a?range=%3Cscript%3E" + "x" * 50)
    assert response.status_code == 200
    assert '<a href="/hosts/gpu-a?range=6h" aria-current="true">' in response.text


def test_the_login_form_sends_a_signed_in_user_on(guarded_site: Site) -> None:
    with httpx.Client(base_url=guarded_site.url, follow_redirects=False) as client:
        assert client.get("/login?next=/alerts").status_code == 200  # not signed in
        client.post("/login", data={"token": READ_TOKEN, "next": "/"})
        response = client.get("/login?next=/alerts")
        assert response.status_code == 303 and response.headers["location"] == "/alerts"
        response = client.get("/login?next=//evil.example/")
        assert response.status_code == 303 and response.headers["location"] == "/"


def _luminance(rgb: list[float]) -> float:
    channels = [c / 255 for c in rgb]
    linear = [c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4 for c in channels]
    return 0.2126 * linear[0] + 0.7152 * linear[1] + 0.0722 * linear[2]


def test_status_colours_have_readable_text(site: Site, browser: Browser) -> None:
    """Every event badge and every fullness tile with text, as the browser paints them,
    has a contrast of 4.5:1 or more (WCAG AA for small text)."""
    browser.open(site.url + "/events")
    kinds = ["orphaned", "runaway", "idle", "filling_up", "gpu_lost", "gpu_back",
             "agent_silent", "reaped", "oom", "stale"]  # fmt: skip
    tiles = [f"c{n}" for n in range(10)]
    pairs = browser.js(
        """
        const out = {};
        const probe = (css, key) => {
          const el = document.createElement('span');
          el.className = css; el.textContent = 'x';
          document.body.appendChild(el);
          const s = getComputedStyle(el);
          out[key] = [s.color, s.backgroundColor];
          el.remove();
        };
        arguments[0].forEach(k => probe('kind ' + k, k));
        arguments[1].forEach(c => probe('t ' + c, c));
        return out;
        """,
        kinds,
        tiles,
    )
    low = {}
    for key, (fg, bg) in pairs.items():
        f, b = (_luminance([float(v) for v in re.findall(r"[\d.]+", c)[:3]]) for c in (fg, bg))
        ratio = (max(f, b) + 0.05) / (min(f, b) + 0.05)
        if ratio < 4.5:
            low[key] = round(ratio, 2)
    assert low == {}


def test_a_short_job_is_drawn_with_a_few_points_not_every_column() -> None:
    columns = 360
    short = [0] * columns
    short[100:103] = [2**30, 2**30, 2**30]
    history = History(
        since=0.0,
        step=60.0,
        layers=[
            Layer(1, 10, "alice", "long", [2**30] * columns, 2**30, 1),
            Layer(2, 11, "bob", "short", short, 2**30, 1),
        ],
        used=[2 * 2**30 if s else 2**30 for s in short],
        total_bytes=80 * 2**30,
    )
    svg = memory_chart(history, [], width=1000, height=340, label="x", now=columns * 60.0)
    paths = re.findall(r'<path class="layer" d="([^"]*)"', svg)
    points = [len(re.findall(r"[ML]", d)) for d in paths]
    assert points[0] == 2 * columns  # the long job: every column, up and back
    assert points[1] == 2 * 5  # the short one: its 3 columns and one either side
    # Its band still starts and ends on the band beneath it (zero thickness there).
    first, *_, last = re.findall(r"([\d.]+),([\d.]+)", paths[1])
    assert first[1] == last[1]


def test_the_events_form_keeps_the_filters_a_bad_one_did_not_spoil(
    site: Site, browser: Browser
) -> None:
    browser.open(site.url + "/events?host=gpu-b&gpu=abc&state=open")
    form = browser.driver.find_element(By.CSS_SELECTOR, "form.filters")
    WebDriverWait(browser.driver, 5).until(lambda d: form.is_displayed())
    assert form.find_element(By.NAME, "host").get_attribute("value") == "gpu-b"
    assert form.find_element(By.NAME, "gpu").get_attribute("value") == ""
    assert "is not a GPU index" in browser.driver.find_element(By.CSS_SELECTOR, ".error").text
    assert_clean(browser, site)
