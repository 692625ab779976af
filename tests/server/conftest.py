"""Server fixtures: real SQLite files and real Postgres schemas, a real uvicorn server.

Postgres tests (``@pytest.mark.postgres``) each get a fresh schema on the ``test``
database, selected through ``search_path`` and dropped afterwards. Without Postgres they
skip on a laptop and fail under ``CI=true``, so CI cannot go green by skipping them.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI
from sqlalchemy import create_engine, text
from sqlalchemy.exc import OperationalError

from gpuwatch.server.app import create_app
from gpuwatch.server.database import Database, create_database
from gpuwatch.server.database.migrate import upgrade
from gpuwatch.settings import ServerSettings
from server.harness import FakeClock, Live, serve

POSTGRES_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def _postgres_available() -> None:
    try:
        engine = create_engine(POSTGRES_URL, connect_args={"connect_timeout": 3})
        with engine.connect():
            pass
        engine.dispose()
    except OperationalError as err:
        if os.environ.get("CI") == "true":
            pytest.fail(f"Postgres is required under CI=true but unreachable: {err}")
        pytest.skip("Postgres at 127.0.0.1:5432 is not reachable")


@contextmanager
def fresh_postgres_schema() -> Iterator[str]:
    """A URL whose connections use a fresh, empty schema, dropped on the way out."""
    _postgres_available()
    schema = f"gwtest_{uuid.uuid4().hex[:12]}"
    admin = create_engine(POSTGRES_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    try:
        yield f"{POSTGRES_URL}?options=-csearch_path%3D{schema}"
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()


@pytest.fixture
def postgres_url() -> Iterator[str]:
    """A URL whose connections use a fresh, empty schema."""
    with fresh_postgres_schema() as url:
        yield url


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'gpuwatch.db'}"


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def database_url(request: pytest.FixtureRequest) -> str:
    """Each test using this runs on both databases."""
    name = "sqlite_url" if request.param == "sqlite" else "postgres_url"
    url: str = request.getfixturevalue(name)
    return url


@pytest.fixture(scope="session")
def migrated_sqlite(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A SQLite file migrated to head once per test process (about 0.1 s a migration)."""
    path = tmp_path_factory.mktemp("migrated") / "gpuwatch.db"
    db = create_database(f"sqlite:///{path}")
    upgrade(db)
    db.dispose()
    return path


@pytest.fixture
def database(database_url: str, request: pytest.FixtureRequest) -> Iterator[Database]:
    """A migrated database (empty tables at head).

    A SQLite one starts as a copy of :func:`migrated_sqlite`, written by the same
    ``upgrade``; ``upgrade`` then runs on the copy too, as on any start (at head it only
    checks the revision and writes ``alembic_version``)."""
    if database_url.startswith("sqlite:///"):
        target = Path(database_url.removeprefix("sqlite:///"))
        if not target.exists():
            shutil.copyfile(request.getfixturevalue("migrated_sqlite"), target)
    db = create_database(database_url)
    upgrade(db)
    yield db
    db.dispose()


@pytest.fixture
def settings(tmp_path: Path, database_url: str) -> ServerSettings:
    return ServerSettings(
        data_dir=tmp_path,
        database_url=database_url,
        scheduler=False,
        sample_interval_seconds=60,
        idle_window_seconds=600,
        leak_min_duration_seconds=1800,
        agent_push_interval_seconds=15,
    )


@pytest.fixture
def app(settings: ServerSettings, database: Database, clock: FakeClock) -> FastAPI:
    return create_app(settings, clock=clock, engine=database.engine)


@pytest.fixture
def live(app: FastAPI, database: Database, clock: FakeClock) -> Iterator[Live]:
    with serve(app) as url, httpx.Client(base_url=url, timeout=10) as client:
        yield Live(url=url, client=client, database=database, clock=clock)
