"""Fixtures for the reaper's tests; the rig itself is ``reaper.rig``."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from reaper.central_rig import Central, central_fixture
from reaper.rig import HistoryServer, Rig, Victim, rig_fixture, victims_fixture
from support.clock import FakeClock


@pytest.fixture
def victims() -> Iterator[Callable[..., Victim]]:
    """Start real processes (``victims(uid=..., stubborn=...)``); all killed afterwards."""
    yield from victims_fixture()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(time.time())


@pytest.fixture
def rig(tmp_path: Path, clock: FakeClock) -> Iterator[Rig]:
    """Fake GPUs in this process on the fake clock; stand-ins stopped afterwards."""
    yield from rig_fixture(tmp_path, clock)


@pytest.fixture
def central(tmp_path: Path) -> Iterator[Central]:
    """A live gpuwatch server (SQLite) this host's agent token may push to."""
    yield from central_fixture(tmp_path)


@pytest.fixture
def agent() -> Iterator[HistoryServer]:
    """A stand-in for this host's agent serving the reaper's history (``agent.serve``)."""
    server = HistoryServer()
    yield server
    server.close()
