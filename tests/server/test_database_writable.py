"""A database that can be read but not written, or that a newer gpuwatch migrated.

Reads alone cannot tell a read-only database (a read-only file or mount, a full disk, a
Postgres standby) from a healthy one, so the upgrade writes, and /healthz and
``gpuwatch_server_database_up`` follow the writes that failed.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from sqlalchemy import event, text

from gpuwatch.errors import DatabaseError
from gpuwatch.server.app import create_app
from gpuwatch.server.database import Database, create_database
from gpuwatch.server.database.core import NoDatabase
from gpuwatch.server.database.migrate import (
    UnknownRevision,
    current_revision,
    require_head,
    upgrade,
)
from gpuwatch.settings import ServerSettings
from server.factories import body, gpu, process, snapshot
from server.harness import FakeClock, make_token, serve


class ReadOnlySwitch:
    """Makes every connection ``database`` hands out read-only while ``on``, as a file
    turned read-only (or a full disk, a Postgres failover to a standby) would."""

    def __init__(self, database: Database) -> None:
        self.on = False
        self.dialect = database.dialect
        event.listen(database.engine, "checkout", self._checkout)

    def _checkout(self, dbapi_connection: Any, _record: Any, _proxy: Any) -> None:
        if self.dialect == "sqlite":
            dbapi_connection.execute(f"PRAGMA query_only = {int(self.on)}")
        else:
            dbapi_connection.read_only = self.on


@pytest.fixture
def switch(database: Database) -> Iterator[ReadOnlySwitch]:
    switch = ReadOnlySwitch(database)
    yield switch
    switch.on = False


def database_up(url: str) -> str:
    lines = httpx.get(f"{url}/metrics").text.splitlines()
    (line,) = [line for line in lines if line.startswith("gpuwatch_server_database_up ")]
    return line.split()[1]


def test_health_and_database_up_follow_writes_that_fail(
    settings: ServerSettings, database: Database, clock: FakeClock, switch: ReadOnlySwitch
) -> None:
    token = make_token(database, "host-1", clock())
    headers = {"Authorization": f"Bearer {token}"}

    def push(n: int) -> int:
        clock.now += 15
        one = body(snapshot(n, [gpu(0, [process(1)])], at=clock()))
        return httpx.post(f"{url}/api/v1/snapshots", json=one, headers=headers).status_code

    app = create_app(settings, clock=clock, engine=database.engine)
    with serve(app) as url:
        assert push(0) == 200
        assert httpx.get(f"{url}/healthz").status_code == 200
        assert database_up(url) == "1.0"

        switch.on = True
        # Reads still work, so before any write fails nothing can know.
        assert httpx.get(f"{url}/healthz").status_code == 200
        assert push(1) == 503
        health = httpx.get(f"{url}/healthz")
        assert health.status_code == 503, health.text
        assert health.json()["detail"] == "database cannot be written, retry later"
        assert health.headers["retry-after"] == "5"
        assert database_up(url) == "0.0"
        assert httpx.get(f"{url}/api/v1/hosts").status_code == 200  # reads are served

        switch.on = False
        # No push needed: the check's own write finds the database writable again.
        assert httpx.get(f"{url}/healthz").status_code == 200
        assert database_up(url) == "1.0"
        assert push(2) == 200


def test_a_busy_database_is_not_unwritable(
    settings: ServerSettings, database: Database, clock: FakeClock
) -> None:
    if database.dialect != "sqlite":
        pytest.skip("the write lock held elsewhere is SQLite's")
    other = create_database(str(database.engine.url))
    app = create_app(settings, clock=clock, engine=database.engine)
    token = make_token(database, "host-1", clock())
    try:
        with serve(app) as url, other.begin_write():  # another process's writer
            started = time.monotonic()
            one = body(snapshot(0, [gpu(0, [process(1)])], at=clock()))
            pushed = httpx.post(
                f"{url}/api/v1/snapshots",
                json=one,
                headers={"Authorization": f"Bearer {token}"},
                timeout=30,
            )
            assert pushed.status_code == 503 and time.monotonic() - started < 20
            assert httpx.get(f"{url}/healthz").status_code == 200
    finally:
        other.dispose()


def test_upgrade_writes_so_a_read_only_database_fails_it(
    database: Database, switch: ReadOnlySwitch
) -> None:
    if database.dialect == "sqlite":
        # Opened read-only (as SQLite opens a file it may not write), where BEGIN
        # IMMEDIATE still succeeds: only a write finds it out.
        path = database.engine.url.database
        read_only = create_database(f"sqlite:///file:{path}?mode=ro&uri=true")
    else:
        read_only, switch.on = database, True
    try:
        with pytest.raises(DatabaseError, match="cannot be written"):
            upgrade(read_only)  # at head already: nothing to migrate, still refused
    finally:
        read_only.dispose()


def test_a_revision_from_a_newer_gpuwatch_is_refused_with_that_advice(database: Database) -> None:
    with database.begin_write() as conn:
        conn.execute(text("UPDATE alembic_version SET version_num = 'ffffffffffff'"))
    advice = "revision ffffffffffff, which this gpuwatch does not know"

    for attempt in (current_revision, require_head, upgrade):
        with pytest.raises(UnknownRevision, match=advice) as raised:
            attempt(database)
        assert "db upgrade" not in str(raised.value)
    with database.engine.connect() as conn:  # and the upgrade changed nothing
        version = conn.execute(text("SELECT version_num FROM alembic_version")).scalar_one()
    assert version == "ffffffffffff"


@pytest.mark.parametrize(
    "url",
    [
        "postgresql+psycopg://postgres:S3CRETpw@127.0.0.1:notaport/test",
        "postgresql+psycopg://postgres:S3CRETpw@[::1/test",
        "sqlite:///gpuwatch.db?timeout=soon",
    ],
)
def test_an_unusable_url_is_a_database_error_without_its_password(url: str) -> None:
    with pytest.raises(DatabaseError, match="unusable database URL") as raised:
        create_database(url)
    assert "S3CRETpw" not in str(raised.value)
    assert "S3CRETpw" not in repr(raised.value)


def test_only_create_makes_a_sqlite_file(tmp_path: Any) -> None:
    path = tmp_path / "typo.db"

    with pytest.raises(NoDatabase, match=f"no database at {path}"):
        create_database(f"sqlite:///{path}", create=False)
    with pytest.raises(DatabaseError, match=f"no directory {tmp_path / 'nope'}"):
        create_database(f"sqlite:///{tmp_path / 'nope' / 'x.db'}")
    assert not path.exists()

    made = create_database(f"sqlite:///{path}")
    upgrade(made)
    made.dispose()
    # Existing: opened read-write, but never created, not even when it goes away.
    existing = create_database(f"sqlite:///{path}", create=False)
    try:
        assert current_revision(existing) is not None
        existing.dispose()
        path.unlink()
        with pytest.raises(DatabaseError, match="unable to open"):
            current_revision(existing)
        assert not path.exists()
    finally:
        existing.dispose()


@pytest.mark.skipif(os.geteuid() != 0, reason="root hands its new file to the directory's owner")
def test_roots_new_database_in_a_service_owned_directory_is_handed_to_that_owner(
    tmp_path: Any,
) -> None:
    # `gpuwatch db upgrade` as root in the service's StateDirectory, before the service
    # made the database: left root's 0600, the service could never open it (exit 7).
    state = tmp_path / "state"
    state.mkdir()
    os.chown(state, 61234, 61234)
    db = create_database(f"sqlite:///{state / 'gpuwatch.db'}")
    try:
        upgrade(db)
    finally:
        db.dispose()
    info = (state / "gpuwatch.db").stat()
    assert info.st_uid == 61234
    assert info.st_mode & 0o777 == 0o600


def test_an_unusable_url_is_a_configuration_error_with_a_hint() -> None:
    # Exit 3, not 7: a URL that can never work is not an outage to retry.
    for url, hint in [
        ("postgres://u@h/db", "write postgresql+psycopg://"),
        ("mysql://u@h/db", "supports sqlite:///PATH and postgresql+psycopg://"),
    ]:
        with pytest.raises(DatabaseError, match="unusable database URL") as raised:
            create_database(url)
        assert raised.value.exit_code == 3
        assert hint in str(raised.value)
