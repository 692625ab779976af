"""Host and GPU pages address exactly the host named, whatever its name holds.

A second audit of the dashboard (driven in headless Chromium) found that Starlette
routes on the decoded path, so the fleet's link to a host named "a/gpus/1"
(``/hosts/a%2Fgpus%2F1``) opened GPU 1 of host "a", and "x/gpus/abc" could not be
opened at all; the API's ``/api/v1/hosts/a%2Fgpus%2F1`` answered 404. Hosts named "."
and ".." had links a browser resolves away (``/hosts/..`` is ``/``).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from html import escape, unescape
from urllib.parse import quote

import pytest
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait
from server.factories import body, gpu, process, snapshot
from server.harness import make_token

from web.browser import Browser
from web.conftest import Site, running_site
from web.test_pages import assert_clean

# Names that end in or hold the GPU route's words, that are or hold dot segments, that
# hold percent signs or slashes at either end; "a" is the host the first would reach.
NAMES = [
    "a",
    "a/gpus/1",
    "x/gpus/abc",
    "a/gpus/0/gpus/1",
    "/gpus/1",
    "gpus",
    "b/",
    "/",
    ".",
    "..",
    "...",
    "./a",
    "../a",
    "%2e%2e",
    "c%2Fd",
]
DOTS = [".", ".."]


@pytest.fixture(scope="module")
def named_site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    """The scenario fleet, plus one host of each name with two GPUs (a process on GPU
    0 whose user tells the hosts apart) and an OOM event on GPU 0."""
    with running_site(tmp_path_factory.mktemp("named")) as site:
        for i, name in enumerate(NAMES):
            token = make_token(site.database, name, site.clock())
            holder = process(8000 + i, used_gib=2, user=f"user{i}")
            snap = snapshot(0, [gpu(0, [holder]), gpu(1, [])], hostname=name, at=site.clock())
            headers = {"Authorization": f"Bearer {token}"}
            pushed = site.client.post("/api/v1/snapshots", json=body(snap), headers=headers)
            assert pushed.status_code == 200, pushed.text
            oom = {"kind": "oom", "hostname": name, "gpu_index": 0, "pid": 8000 + i,
                   "summary": f"OOM {i}", "evidence": {}, "occurred_at": site.clock() - 60}  # fmt: skip
            reported = site.client.post("/api/v1/events", json=oom, headers=headers)
            assert reported.status_code == 200, reported.text
        yield site


def shown_host(html: str) -> str:
    """The hostname a host or GPU page is about: the first name in its heading."""
    heading = re.search(r"<h1><bdi>(.*?)</bdi>", html, re.S)
    assert heading is not None, html[:300]
    return unescape(heading.group(1))


def card(html: str, name: str) -> tuple[str, str]:
    """The fleet card of ``name``: its link and the prefix of its tiles' links."""
    found = re.search(
        rf'data-h="{re.escape(escape(name))}" data-t="[^"]*" data-g="([^"]*)">'
        r'<h2><a href="([^"]*)">',
        html,
    )
    assert found is not None, name
    return unescape(found.group(2)), unescape(found.group(1))


def test_every_link_to_a_host_or_gpu_opens_that_host(named_site: Site) -> None:
    client = named_site.client
    fleet = client.get("/").text
    for name in NAMES:
        host_link, gpus = card(fleet, name)
        page = client.get(host_link)
        assert page.status_code == 200 and shown_host(page.text) == name, (name, host_link)
        # The range switch and the GPU links of the host page stay on this host.
        for link in re.findall(r'href="(/hosts/[^"]*)"', page.text):
            answer = client.get(unescape(link))
            assert answer.status_code == 200 and shown_host(answer.text) == name, link
        for index in (0, 1):
            page = client.get(f"{gpus}{index}")
            assert page.status_code == 200, (name, gpus)
            assert shown_host(page.text) == name and f" · GPU {index} " in page.text
        missing = client.get(f"{gpus}7")
        assert missing.status_code == 404 and "No GPU" in missing.text


def test_the_events_pages_links_open_the_host_of_the_row(named_site: Site) -> None:
    client = named_site.client
    page = client.get("/events?kind=oom").text
    rows = re.findall(r"<tr>(?:(?!<th>).)*?</tr>", page, re.S)
    seen = set()
    for row in rows:
        links = [unescape(h) for h in re.findall(r'href="(/hosts/[^"]*)"', row)]
        names = {shown_host(client.get(link).text) for link in links}
        assert len(links) == 2 and len(names) == 1, row  # the GPU's and the host's
        seen |= names
    assert set(NAMES) <= seen


def test_old_links_still_open_the_host_they_named(named_site: Site) -> None:
    """Links as the dashboard wrote them before (every name one percent-encoded
    segment) still open the same page; spelled "%2E" a dot name reaches its host too
    (only a browser resolves the dots away)."""
    client = named_site.client
    for name in NAMES:
        segment = quote(name, safe="") if name not in DOTS else name.replace(".", "%2E")
        assert shown_host(client.get(f"/hosts/{segment}").text) == name
        assert shown_host(client.get(f"/hosts/{segment}/gpus/1?range=1h").text) == name
    # Unencoded, the slashes are separators: GPU 1 of "a", as the URL says.
    assert shown_host(client.get("/hosts/a/gpus/1").text) == "a"
    assert client.get("/hosts/a/gpus").status_code == 404
    assert client.get("/hosts/").status_code == 404
    assert client.get("/hosts/?name=nobody").status_code == 404


def test_the_api_reads_the_host_named_whatever_its_name(named_site: Site) -> None:
    client = named_site.client
    for name in NAMES:
        segment = quote(name, safe="") if name not in DOTS else name.replace(".", "%2E")
        answer = client.get(f"/api/v1/hosts/{segment}")
        assert answer.status_code == 200 and answer.json()["hostname"] == name, name
    assert client.get("/api/v1/hosts/a/gpus/1").status_code == 404
    assert client.get("/api/v1/hosts/nobody").status_code == 404


@pytest.mark.parametrize("what", ["host", "tile"])
def test_a_click_in_the_browser_opens_the_host_named(
    what: str, named_site: Site, browser: Browser
) -> None:
    """What the audit did: Chromium, the fleet page, a click on the host's name or on
    its GPU 1 tile; the page shown must be that host's."""
    for name in NAMES:
        browser.open(named_site.url + "/")
        cards = browser.driver.find_elements(By.CSS_SELECTOR, "section.host")
        (chosen,) = [c for c in cards if c.get_attribute("data-h") == name]
        target = chosen.find_element(
            By.CSS_SELECTOR, "h2 a" if what == "host" else "a.t:nth-child(2)"
        )
        browser.js("arguments[0].scrollIntoView()", target)
        target.click()
        WebDriverWait(browser.driver, 20).until(
            lambda d: (
                "Fleet ·" not in d.title
                and d.execute_script("return document.readyState") == "complete"
            )
        )
        heading = browser.driver.find_element(By.CSS_SELECTOR, "h1 bdi")
        assert heading.get_attribute("textContent") == name, browser.driver.current_url
        if what == "tile":
            h1 = browser.driver.find_element(By.TAG_NAME, "h1").get_attribute("textContent")
            assert " · GPU 1 " in h1
        assert_clean(browser, named_site)
