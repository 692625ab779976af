"""The dashboard in headless chromium, on a server holding the scenario fleet
(web/scenario.py): every page loads with no console error and only this server's
assets, tiles link to their GPU, charts carry data, filters narrow the events, the
firing alert shows, and nothing an agent sent runs as markup. A full-page screenshot
of each page lands in ``test-artifacts/web/``."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from selenium.webdriver.common.action_chains import ActionChains
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import Select, WebDriverWait

from web.browser import Browser
from web.conftest import Site
from web.scenario import MARKUP_COMMAND

PAGES = {
    "fleet": "/",
    # Not "gpu": a test whose id says gpu is skipped on machines without a driver.
    "host-detail": "/hosts/gpu-a",
    "device-detail": "/hosts/gpu-a/gpus/1?range=1h",
    "events": "/events",
    "alerts": "/alerts",
}


def assert_clean(browser: Browser, site: Site) -> None:
    """No console error, and every URL the page loaded is on the server's origin."""
    assert browser.console_errors() == []
    origin = urlsplit(site.url)
    foreign = [u for u in browser.loaded_urls() if urlsplit(u)[:2] != origin[:2]]
    assert foreign == []


def layer_heights(browser: Browser) -> list[set[float]]:
    """The distinct y coordinates of each stacked layer of the page's charts."""
    paths = browser.driver.find_elements(By.CSS_SELECTOR, "svg.chart path.layer")
    return [
        {float(y) for y in re.findall(r"[ML]\s*[\d.]+,([\d.]+)", p.get_attribute("d"))}
        for p in paths
    ]


@pytest.mark.parametrize("name", list(PAGES))
def test_each_page_loads_cleanly_and_is_captured(
    name: str, site: Site, browser: Browser, tmp_path: Path
) -> None:
    browser.open(site.url + PAGES[name])
    assert browser.driver.find_element(By.TAG_NAME, "h1").text
    assert_clean(browser, site)
    shot = browser.screenshot(f"dashboard-{name}", tmp_path)
    assert shot.stat().st_size > 10_000


def test_a_tile_links_to_its_gpu_and_the_chart_has_data(site: Site, browser: Browser) -> None:
    browser.open(site.url + "/")
    host, index = site.fleet.filling
    tile = browser.driver.find_element(
        By.CSS_SELECTOR, f'section.host[data-h="{host}"] a.t[href$="/gpus/{index}"]'
    )
    assert "f" in tile.get_attribute("class").split()  # filling up
    assert tile.text == "eri+"  # erin holds the largest process, frank the other
    tile.click()
    WebDriverWait(browser.driver, 10).until(lambda d: d.current_url.endswith(f"/gpus/{index}"))
    assert browser.driver.find_element(By.TAG_NAME, "h1").text.startswith(f"{host} · GPU {index}")
    heights = layer_heights(browser)
    assert len(heights) == 2  # erin and frank
    assert max(len(h) for h in heights) > 20  # erin's grows: a new height every minute
    # The leak and the filling-up it causes are marked on the timeline, as is the OOM.
    marks = browser.driver.find_elements(By.CSS_SELECTOR, "svg.chart .mark")
    kinds = {m.get_attribute("class").split()[-1] for m in marks}
    assert {"filling_up", "runaway", "oom"} <= kinds
    assert_clean(browser, site)


def test_tiles_show_fullness_holders_and_flags(site: Site, browser: Browser) -> None:
    browser.open(site.url + "/")

    def tile(where: tuple[str, int]) -> tuple[set[str], str, str]:
        element = browser.driver.find_element(
            By.CSS_SELECTOR, f'section.host[data-h="{where[0]}"] a.t[href$="/gpus/{where[1]}"]'
        )
        # The tooltip is worded by the page's script when the tile is first hovered.
        assert not element.get_attribute("title")
        ActionChains(browser.driver).move_to_element(element).perform()
        return (
            set(element.get_attribute("class").split()),
            element.text,
            element.get_attribute("title"),
        )

    classes, text, title = tile(site.fleet.orphaned)
    assert "o" in classes and text == "gho+"  # the dead process is the largest; carol too
    assert title.splitlines() == [
        f"GPU {site.fleet.orphaned[1]}: 22.0 of 80.0 GiB (27%)",
        "largest: ghost 12.0 GiB · 2 processes, 2 users",
        "orphaned",
    ]
    classes, text, title = tile(site.fleet.idle)
    assert "i" in classes and text == "dav" and "idle holder" in title
    classes, text, title = tile(site.fleet.lost)
    assert {"l", "u"} <= classes and text == "✕"
    assert "no current reading" in title and "fallen off the bus" in title
    classes, text, title = tile(site.fleet.empty)
    assert "c0" in classes and text == "" and "no processes" in title
    classes, _, title = tile(site.fleet.steady)  # 50 of 80 GiB
    assert "c6" in classes and "50.0 of 80.0 GiB (62%)" in title
    silent = browser.driver.find_element(
        By.CSS_SELECTOR, f'section.host[data-h="{site.fleet.silent_host}"]'
    )
    assert "silent" in silent.text and "flagged" in silent.get_attribute("class")
    # The host filter and the flagged-only switch hide host cards in the page.
    browser.driver.find_element(By.ID, "onlyflagged").click()
    visible = [
        h.get_attribute("data-h")
        for h in browser.driver.find_elements(By.CSS_SELECTOR, "section.host")
        if h.is_displayed()
    ]
    assert visible == ["gpu-a", "gpu-b", "gpu-c"]  # every host has a flag here
    browser.driver.find_element(By.ID, "hostfilter").send_keys("gpu-b")
    visible = [
        h.get_attribute("data-h")
        for h in browser.driver.find_elements(By.CSS_SELECTOR, "section.host")
        if h.is_displayed()
    ]
    assert visible == ["gpu-b"]
    assert_clean(browser, site)


def event_rows(browser: Browser) -> list[dict[str, str]]:
    headers = [h.text for h in browser.driver.find_elements(By.CSS_SELECTOR, "table.events th")]
    return [
        dict(zip(headers, [c.text for c in row.find_elements(By.TAG_NAME, "td")], strict=True))
        for row in browser.driver.find_elements(By.CSS_SELECTOR, "table.events tbody tr")
    ]


def test_event_filters_narrow_the_list(site: Site, browser: Browser) -> None:
    browser.open(site.url + "/events")
    everything = event_rows(browser)
    assert {r["Host"] for r in everything} == {"gpu-a", "gpu-b"}
    assert len(browser.driver.find_elements(By.CSS_SELECTOR, "svg.timeline .mark")) == len(
        everything
    )

    form = browser.driver.find_element(By.CSS_SELECTOR, "form.filters")
    form.find_element(By.NAME, "host").send_keys("gpu-b")
    form.find_element(By.CSS_SELECTOR, "button[type=submit]").click()
    WebDriverWait(browser.driver, 10).until(lambda d: "host=gpu-b" in d.current_url)
    on_b = event_rows(browser)
    assert 0 < len(on_b) < len(everything) and {r["Host"] for r in on_b} == {"gpu-b"}

    form = browser.driver.find_element(By.CSS_SELECTOR, "form.filters")
    Select(form.find_element(By.NAME, "kind")).select_by_value("idle")
    form.find_element(By.CSS_SELECTOR, "button[type=submit]").click()
    WebDriverWait(browser.driver, 10).until(lambda d: "kind=idle" in d.current_url)
    idle = event_rows(browser)
    assert {(r["Kind"], r["User"]) for r in idle} == {("idle", "dave"), ("idle", "carol")}

    form = browser.driver.find_element(By.CSS_SELECTOR, "form.filters")
    form.find_element(By.NAME, "user").send_keys("dave")
    Select(form.find_element(By.NAME, "state")).select_by_value("open")
    form.find_element(By.CSS_SELECTOR, "button[type=submit]").click()
    WebDriverWait(browser.driver, 10).until(lambda d: "user=dave" in d.current_url)
    assert [(r["Kind"], r["User"], r["GPU"]) for r in event_rows(browser)] == [
        ("idle", "dave", "1")
    ]
    assert_clean(browser, site)


def test_an_event_time_range_keeps_the_events_that_overlap_it(site: Site, browser: Browser) -> None:
    # The reap happened at 08:20 UTC; the OOM at 08:37:30; the GPU was lost at 08:39:30.
    browser.open(site.url + "/events?since=2027-01-15T08:36&until=2027-01-15T08:38&kind=oom")
    assert [r["Kind"] for r in event_rows(browser)] == ["oom"]
    browser.open(site.url + "/events?since=2027-01-15T08:36&until=2027-01-15T08:38&kind=reaped")
    assert event_rows(browser) == []
    form = browser.driver.find_element(By.CSS_SELECTOR, "form.filters")
    assert form.find_element(By.NAME, "since").get_attribute("value") == "2027-01-15T08:36"
    assert_clean(browser, site)


def test_the_alerts_page_shows_the_firing_alert_and_the_silence(
    site: Site, browser: Browser
) -> None:
    browser.open(site.url + "/alerts")
    firing = browser.driver.find_elements(By.CSS_SELECTOR, "table.alerts")[0]
    text = firing.text
    assert "gpu_lost" in text and "fallen off the bus" in text
    link = firing.find_element(By.LINK_TEXT, "gpu-b GPU 2")
    assert link.get_attribute("href").endswith("/hosts/gpu-b/gpus/2")
    silences = browser.driver.find_element(By.CSS_SELECTOR, "table.silences").text
    assert "rule=idle_holder" in silences and "active" in silences
    badge = browser.driver.find_element(By.CSS_SELECTOR, "header .badge.firing").text
    assert int(badge) >= 1
    assert_clean(browser, site)


def test_what_agents_send_is_shown_as_text_never_run(site: Site, browser: Browser) -> None:
    browser.open(site.url + "/hosts/gpu-a")
    assert browser.js("return document.querySelectorAll('script').length") == 1  # ours
    bold = "return [...document.querySelectorAll('b')].filter(b => b.textContent == 'bold').length"
    assert browser.js(bold) == 0
    commands = [
        c.text for c in browser.driver.find_elements(By.CSS_SELECTOR, "table.processes code")
    ]
    assert MARKUP_COMMAND in commands
    assert_clean(browser, site)


def test_the_api_docs_render_offline(site: Site, browser: Browser, tmp_path: Path) -> None:
    browser.open(site.url + "/docs")
    WebDriverWait(browser.driver, 20).until(
        lambda d: d.find_elements(By.CSS_SELECTOR, ".swagger-ui .opblock-summary-path")
    )
    title = browser.driver.find_element(By.CSS_SELECTOR, ".swagger-ui .info .title").text
    assert title.startswith("gpuwatch server")
    paths = {e.text for e in browser.driver.find_elements(By.CSS_SELECTOR, ".opblock-summary-path")}
    assert "/api/v1/fleet" in paths
    assert_clean(browser, site)
    browser.screenshot("dashboard-api-docs", tmp_path)


def test_a_dead_pid_is_orphaned_not_idle_in_the_api_and_the_process_table(site: Site) -> None:
    """The audit's ``gpuwatch demo``: a dead PID still holding memory, its orphaned
    (dead_pid) event open, read "idle 53 s" with no orphaned flag, and the API said
    ``"orphaned": false``, as if its owner could come back for it."""
    host, index = site.fleet.orphaned
    listed = site.client.get("/api/v1/processes", params={"host": host, "open": "true"})
    by_pid = {p["pid"]: p for p in listed.json()["items"]}
    ghost, dave = by_pid[4100], by_pid[301]
    assert ghost["orphaned"] is True and ghost["orphan_reason"] == "dead_pid"
    assert ghost["idle_since"] is None and ghost["idle_seconds"] is None
    assert dave["orphaned"] is False and dave["orphan_reason"] is None
    assert dave["idle_seconds"] > 0  # an idle process, alive, stays idle
    rows = {}
    for path in (f"/hosts/{host}", f"/hosts/{host}/gpus/{index}"):
        page = site.client.get(path).text
        rows[path] = re.findall(r"<tr><td>(?:<a [^>]*>\d+</a></td><td>)?(\d+)</td>(.*?)</tr>", page)
    for path, found in rows.items():
        (ghost_row,) = [cells for pid, cells in found if pid == "4100"]
        assert "orphaned: process gone" in ghost_row and "idle" not in ghost_row, path
    (dave_row,) = [cells for pid, cells in rows[f"/hosts/{host}"] if pid == "301"]
    assert '<span class="kind idle">idle ' in dave_row


def test_one_process_is_one_process(site: Site) -> None:
    """The audit read "1 processes: bob" on a GPU's line."""
    host, index = site.fleet.idle  # dave's one process
    page = site.client.get(f"/hosts/{host}/gpus/{index}").text
    assert " · 1 process: <bdi>dave</bdi>" in page and "1 processes" not in page
