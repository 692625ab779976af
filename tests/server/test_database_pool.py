"""Postgres connections are pinged before reuse only when they sat idle in the pool
(gpuwatch/server/database/core.py, ``_ping_when_idle``): one the database dropped while
idle is replaced unseen; one back in use at once is not pinged, so a push does not pay
a round trip for it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.exc import OperationalError

from gpuwatch.server.database import Database, create_database
from gpuwatch.server.database import core as database_core
from gpuwatch.server.database.core import is_unavailable
from server.conftest import POSTGRES_URL

pytestmark = pytest.mark.postgres


@pytest.fixture
def database(postgres_url: str) -> Iterator[Database]:
    db = create_database(postgres_url)
    yield db
    db.dispose()


def _backend_pid(database: Database) -> int:
    with database.writer() as session:
        pid: int = session.execute(text("SELECT pg_backend_pid()")).scalar_one()
        session.commit()
    return pid


def _terminate(pid: int) -> None:
    """What a Postgres restart does to a pooled connection, while it sits in the pool."""
    admin = create_engine(POSTGRES_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        assert conn.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid}).scalar()
    admin.dispose()


def test_a_connection_dropped_while_idle_is_replaced_before_use(
    database: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(database_core, "PING_AFTER_IDLE_SECONDS", 0.0)  # every reuse is idle
    dropped = _backend_pid(database)
    _terminate(dropped)
    # The ping finds it dead; the pool opens another, and the write goes through.
    assert _backend_pid(database) != dropped


def test_a_connection_back_in_use_at_once_is_not_pinged(
    database: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(database_core, "PING_AFTER_IDLE_SECONDS", 3600.0)
    dropped = _backend_pid(database)
    _terminate(dropped)
    # No ping: the transaction meets the dead connection (ingest answers this 503 and
    # the agent retries), and the pool is recycled for the next one.
    with pytest.raises(OperationalError) as failed:
        _backend_pid(database)
    assert is_unavailable(failed.value)
    assert _backend_pid(database) != dropped
