"""Fixtures shared by every test area."""

from __future__ import annotations

import os
import shutil

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip GPU tests where there is no NVIDIA driver; everything else must run."""
    has_driver = os.path.exists("/dev/nvidiactl") or shutil.which("nvidia-smi") is not None
    if has_driver:
        return
    skip = pytest.mark.skip(reason="no NVIDIA driver on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
