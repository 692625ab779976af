"""Dashboard fixtures: a real server (uvicorn on a real SQLite file) holding the
scenario fleet, with and without a read token, and one headless chromium."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from server.harness import FakeClock, serve

from gpuwatch.server.app import create_app
from gpuwatch.server.database import Database, create_database
from gpuwatch.server.database.migrate import upgrade
from gpuwatch.settings import ServerSettings
from web.browser import Browser, chromium
from web.scenario import Fleet, populate

READ_TOKEN = "dashboard-read-token-0123456789"


@dataclass
class Site:
    """A running server with the scenario in its database."""

    url: str
    client: httpx.Client
    database: Database
    clock: FakeClock
    settings: ServerSettings
    app: Any
    fleet: Fleet


def site_settings(data_dir: Path, **overrides: Any) -> ServerSettings:
    return ServerSettings(
        data_dir=data_dir,
        database_url=f"sqlite:///{data_dir / 'gpuwatch.db'}",
        scheduler=False,
        sample_interval_seconds=60,
        idle_window_seconds=600,
        leak_min_duration_seconds=1800,
        agent_push_interval_seconds=15,
        **overrides,
    )


@contextmanager
def running_site(data_dir: Path, **overrides: Any) -> Iterator[Site]:
    settings = site_settings(data_dir, **overrides)
    database = create_database(settings.resolved_database_url())
    upgrade(database)
    clock = FakeClock()
    app = create_app(settings, clock=clock, engine=database.engine)
    headers = {"Authorization": f"Bearer {READ_TOKEN}"} if "read_token" in overrides else {}
    try:
        with serve(app) as url, httpx.Client(base_url=url, timeout=30, headers=headers) as client:
            fleet = populate(client, database, clock, settings, app)
            yield Site(url, client, database, clock, settings, app, fleet)
    finally:
        database.dispose()


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    """Reads open (no read token)."""
    with running_site(tmp_path_factory.mktemp("site")) as running:
        yield running


@pytest.fixture(scope="module")
def guarded_site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    """``read_token`` set; ``client`` sends it as a bearer token."""
    with running_site(tmp_path_factory.mktemp("guarded"), read_token=READ_TOKEN) as running:
        yield running


@pytest.fixture(scope="session")
def browser() -> Iterator[Browser]:
    with chromium() as running:
        yield running
