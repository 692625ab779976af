"""One page in headless Chromium, for the tests that need a real browser's rules (which
requests it sends cross-site, which names it resolves) rather than the dashboard's
driven session (tests/web/browser.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest


def chromium_binary() -> str:
    """Chromium's path; the test is skipped where it is not installed."""
    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    if binary is None:
        pytest.skip("chromium is not installed")
    return binary


def dump_dom(url: str, profile: Path, *extra: str) -> str:
    """The page's DOM after Chromium ran its scripts (network included), with a
    profile of its own under ``profile`` and ``extra`` switches."""
    result = subprocess.run(
        [
            chromium_binary(),
            "--headless=new",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--no-first-run",
            "--disable-background-networking",
            f"--user-data-dir={profile}",
            "--virtual-time-budget=5000",
            *extra,
            "--dump-dom",
            url,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "HOME": str(profile)},
    )
    return result.stdout
