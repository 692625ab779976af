"""The page of a retired host (``gpuwatch token revoke --retire``) in headless chromium:
marked retired, with when, and its last readings shown as stale, not current."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from selenium.webdriver.common.by import By

from gpuwatch.server.hosts.retire import retire_host
from web.browser import Browser
from web.conftest import Site, running_site
from web.test_pages import assert_clean


@pytest.fixture(scope="module")
def retired_site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    """The scenario fleet with its silent host, gpu-c, retired."""
    with running_site(tmp_path_factory.mktemp("retired")) as site:
        with site.database.writer() as session:
            done = retire_host(
                session=session,
                dialect=site.database.dialect,
                hostname=site.fleet.silent_host,
                now=site.clock(),
            )
            assert done is not None
            session.commit()
        yield site


def test_a_retired_host_is_marked_retired_and_its_figures_stale(
    retired_site: Site, browser: Browser, tmp_path: Path
) -> None:
    site, host = retired_site, retired_site.fleet.silent_host
    site.clock.now += 7200
    browser.open(f"{site.url}/hosts/{host}")
    heading = browser.driver.find_element(By.TAG_NAME, "h1")
    badge = heading.find_element(By.CSS_SELECTOR, ".badge.retired")
    assert badge.text == "retired 2 h ago"
    assert "silent" not in heading.text
    notice = browser.driver.find_element(By.CSS_SELECTOR, "p.meta.retired")
    assert notice.text.startswith("Retired 20") and "no longer watched" in notice.text
    lines = browser.driver.find_elements(By.CSS_SELECTOR, "section.card.gpu p.meta.stale")
    assert lines and all("no current reading: host retired" in p.text for p in lines)
    headings = [h.text for h in browser.driver.find_elements(By.TAG_NAME, "h2")]
    assert any(h.startswith("Processes at the last report") for h in headings)
    assert_clean(browser, site)
    browser.screenshot("dashboard-retired-host", tmp_path)
