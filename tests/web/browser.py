"""Headless Debian chromium driven through Selenium and Debian's chromedriver.

One browser per test session. :meth:`Browser.open` loads a page and hands back what
the tests check on every page: the console's errors and every URL the page loaded.
Screenshots are full pages (Chrome DevTools' ``captureBeyondViewport``), written to
the test's ``tmp_path`` and copied to ``test-artifacts/web/`` (ignored by git), where
CI keeps them.
"""

from __future__ import annotations

import base64
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NoReturn

import pytest

ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts" / "web"
WINDOW = (1440, 1000)
MAX_SCREENSHOT_HEIGHT = 6000


class Browser:
    def __init__(self, driver: Any) -> None:
        self.driver = driver

    def open(self, url: str) -> None:
        """Load ``url`` (Selenium waits for the load event), with the console cleared."""
        self.driver.get_log("browser")  # drop what an earlier page logged
        self.driver.get(url)

    def console_errors(self) -> list[str]:
        """Messages logged at error level since the page was opened (this empties the
        browser's buffer)."""
        return [
            entry["message"]
            for entry in self.driver.get_log("browser")
            if entry["level"] == "SEVERE"
        ]

    def loaded_urls(self) -> list[str]:
        """The document's URL and every resource it fetched (scripts, styles, images,
        fonts, XHR)."""
        urls: list[str] = self.driver.execute_script(
            "return [location.href].concat("
            "performance.getEntriesByType('resource').map(function (e) { return e.name; }))"
        )
        return urls

    def js(self, script: str, *args: Any) -> Any:
        return self.driver.execute_script(script, *args)

    def screenshot(self, name: str, into: Path) -> Path:
        """A full-page PNG as ``into/name.png``, copied to ``test-artifacts/web/``."""
        metrics = self.driver.execute_cdp_cmd("Page.getLayoutMetrics", {})
        size = metrics.get("cssContentSize") or metrics["contentSize"]
        clip = {
            "x": 0,
            "y": 0,
            "width": max(WINDOW[0], int(size["width"])),
            "height": min(MAX_SCREENSHOT_HEIGHT, max(WINDOW[1], int(size["height"]))),
            "scale": 1,
        }
        shot = self.driver.execute_cdp_cmd(
            "Page.captureScreenshot",
            {"format": "png", "captureBeyondViewport": True, "clip": clip},
        )
        into.mkdir(parents=True, exist_ok=True)
        path = into / f"{name}.png"
        path.write_bytes(base64.b64decode(shot["data"]))
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, ARTIFACTS / path.name)
        return path


def _unavailable(reason: str) -> NoReturn:
    """Skip on a laptop without chromium; under CI the browser is required."""
    if os.environ.get("CI"):
        pytest.fail(f"headless chromium is required under CI: {reason}")
    pytest.skip(reason)


@contextmanager
def chromium() -> Iterator[Browser]:
    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    driver_path = shutil.which("chromedriver")
    if binary is None or driver_path is None:
        _unavailable(
            "chromium and chromedriver are needed (apt-get install chromium chromium-driver)"
        )
    try:
        from selenium import webdriver
        from selenium.common.exceptions import WebDriverException
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        _unavailable("selenium is not installed (pip install -e '.[dev]')")
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for argument in (
        "--headless=new",
        "--no-sandbox",  # tests run as root in CI
        "--disable-dev-shm-usage",
        "--disable-gpu",
        f"--window-size={WINDOW[0]},{WINDOW[1]}",
        "--no-first-run",
        "--disable-extensions",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--lang=en-US",
    ):
        options.add_argument(argument)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    try:
        driver = webdriver.Chrome(options=options, service=Service(executable_path=driver_path))
    except WebDriverException as err:
        _unavailable(f"chromium did not start: {str(err).splitlines()[0]}")
    driver.set_page_load_timeout(60)
    try:
        yield Browser(driver)
    finally:
        driver.quit()
