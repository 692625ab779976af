"""A database that stops taking writes in ways reads do not show, and comes back:
a Postgres role that loses its write permission, a session default turned read-only
and back, a disk with room for a write that changes nothing but not for a push. And
a SQLite URI that read-only commands must not create.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import create_engine, event, text
from sqlalchemy.engine import make_url

from gpuwatch.errors import DatabaseError
from gpuwatch.server.app import create_app
from gpuwatch.server.database import Database, create_database
from gpuwatch.server.database.migrate import current_revision
from gpuwatch.settings import ServerSettings
from server.conftest import POSTGRES_URL
from server.factories import big_host, body, gpu, process, snapshot
from server.harness import FakeClock, make_token, serve


def database_up(url: str) -> str:
    lines = httpx.get(f"{url}/metrics").text.splitlines()
    (line,) = [line for line in lines if line.startswith("gpuwatch_server_database_up ")]
    return line.split()[1]


class Pushes:
    def __init__(self, url: str, token: str, clock: FakeClock) -> None:
        self.url, self.token, self.clock, self.n = url, token, clock, 0

    def __call__(self, big: bool = False, *, hostname: str = "host-1", token: str = "") -> int:
        """A push of ``hostname`` (with ``token``): big, a first push of a host writes
        a push's worth of new rows (32 GPUs, 300 lifetimes)."""
        self.n += 1
        self.clock.now += 15
        one = (
            big_host(self.n, hostname=hostname, gpus=32, procs=300)
            if big
            else snapshot(self.n, [gpu(0, [process(1)])], hostname=hostname)
        )
        one = one.model_copy(update={"collected_at": self.clock()})
        headers = {"Authorization": f"Bearer {token or self.token}"}
        pushed = httpx.post(
            f"{self.url}/api/v1/snapshots", json=body(one), headers=headers, timeout=30
        )
        return pushed.status_code


@pytest.fixture
def role(database: Database) -> Iterator[tuple[str, str, str]]:
    """A login role with every right on the test's schema: (its name, a URL as it, the
    schema)."""
    if database.dialect != "postgresql":
        pytest.skip("roles and session defaults are Postgres's")
    name = f"gw_{uuid.uuid4().hex[:10]}"
    admin = create_engine(POSTGRES_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f"CREATE ROLE {name} LOGIN"))
    url = make_url(str(database.engine.url)).set(username=name)
    with database.engine.connect() as conn:  # in the test's schema (search_path)
        schema = conn.execute(text("SELECT current_schema()")).scalar_one()
        conn.execute(text(f'GRANT ALL ON SCHEMA "{schema}" TO {name}'))
        conn.execute(text(f'GRANT ALL ON ALL TABLES IN SCHEMA "{schema}" TO {name}'))
        conn.execute(text(f'GRANT ALL ON ALL SEQUENCES IN SCHEMA "{schema}" TO {name}'))
        conn.commit()
    try:
        yield name, url.render_as_string(hide_password=False), schema
    finally:
        with admin.connect() as conn:
            conn.execute(
                text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = :r"),
                {"r": name},
            )
            conn.execute(text(f'REVOKE ALL ON ALL TABLES IN SCHEMA "{schema}" FROM {name}'))
            conn.execute(text(f'REVOKE ALL ON ALL SEQUENCES IN SCHEMA "{schema}" FROM {name}'))
            conn.execute(text(f'REVOKE ALL ON SCHEMA "{schema}" FROM {name}'))
            conn.execute(text(f"DROP OWNED BY {name}"))
            conn.execute(text(f"DROP ROLE {name}"))
        admin.dispose()


def test_a_role_that_loses_write_permission_is_unwritable_until_granted_again(
    settings: ServerSettings, database: Database, clock: FakeClock, role: tuple[str, str, str]
) -> None:
    name, role_url, schema = role
    as_role = create_database(role_url)
    token = make_token(database, "host-1", clock())
    app = create_app(settings, clock=clock, engine=as_role.engine)
    try:
        with serve(app) as url, database.engine.connect() as admin:
            push = Pushes(url, token, clock)
            assert push() == 200
            tables = f'ALL TABLES IN SCHEMA "{schema}"'
            admin.execute(text(f"REVOKE INSERT, UPDATE, DELETE ON {tables} FROM {name}"))
            admin.commit()
            assert push() == 503  # was 500: insufficient_privilege (42501)
            health = httpx.get(f"{url}/healthz")
            assert health.status_code == 503, health.text
            assert database_up(url) == "0.0"
            assert httpx.get(f"{url}/api/v1/hosts").status_code == 200  # reads are served

            admin.execute(text(f"GRANT ALL ON {tables} TO {name}"))
            admin.commit()
            assert httpx.get(f"{url}/healthz").status_code == 200
            assert database_up(url) == "1.0"
            assert push() == 200
    finally:
        as_role.dispose()


def test_pooled_sessions_that_were_read_only_are_discarded(
    settings: ServerSettings, database: Database, clock: FakeClock, role: tuple[str, str, str]
) -> None:
    """``default_transaction_read_only`` on (here the role's, as ``ALTER DATABASE``
    sets it for the database) and off again: sessions opened in between keep it, and
    the server answered 503 until restarted."""
    name, role_url, _schema = role
    as_role = create_database(role_url)
    token = make_token(database, "host-1", clock())
    app = create_app(settings, clock=clock, engine=as_role.engine)

    def session_default(value: str) -> None:
        with database.engine.connect() as admin:
            admin.execute(text(f"ALTER ROLE {name} SET default_transaction_read_only = {value}"))
            admin.commit()

    try:
        with serve(app) as url:
            push = Pushes(url, token, clock)
            assert push() == 200
            session_default("on")
            as_role.engine.pool.dispose()  # new sessions from now on: read-only
            assert push() == 503
            assert database_up(url) == "0.0"
            assert httpx.get(f"{url}/healthz").status_code == 503
            # Sessions opened while it was on, pooled: none of them may serve a write.
            for _ in range(3):
                assert httpx.get(f"{url}/api/v1/hosts").status_code == 200

            session_default("off")
            assert httpx.get(f"{url}/healthz").status_code == 200
            assert database_up(url) == "1.0"
            assert [push() for _ in range(5)] == [200] * 5
    finally:
        session_default("default")
        as_role.dispose()


def test_room_for_a_write_that_changes_nothing_is_not_room_for_a_push(
    settings: ServerSettings, database: Database, clock: FakeClock
) -> None:
    """A nearly full disk, as SQLite's page limit makes one: a write that changes
    nothing fits, a push does not. /healthz followed the one that changes nothing."""
    if database.dialect != "sqlite":
        pytest.skip("a page limit is SQLite's")
    limit: dict[str, int | None] = {"pages": None}

    def checkout(dbapi_connection: Any, _record: Any, _proxy: Any) -> None:
        pages = limit["pages"]
        dbapi_connection.execute(f"PRAGMA max_page_count = {pages or 1073741823}")

    event.listen(database.engine, "checkout", checkout)
    token = make_token(database, "host-1", clock())
    new = make_token(database, "host-2", clock())
    app = create_app(settings, clock=clock, engine=database.engine)
    with serve(app) as url:
        push = Pushes(url, token, clock)
        assert push(big=True) == 200
        with database.engine.connect() as conn:
            conn.exec_driver_sql("PRAGMA wal_checkpoint(TRUNCATE)")
            limit["pages"] = conn.exec_driver_sql("PRAGMA page_count").scalar_one() + 2
        assert push() == 200  # fits: rewrites pages it has
        assert push(big=True, hostname="host-2", token=new) == 503  # database or disk is full
        health = httpx.get(f"{url}/healthz")
        assert health.status_code == 503, health.text  # was 200: the no-op write fitted
        assert database_up(url) == "0.0"
        assert push(big=True, hostname="host-2", token=new) == 503

        limit["pages"] += 2000  # room again
        assert httpx.get(f"{url}/healthz").status_code == 200
        assert database_up(url) == "1.0"
        assert push(big=True, hostname="host-2", token=new) == 200
        with database.engine.connect() as conn:  # the probes left nothing behind
            names = conn.exec_driver_sql("SELECT hostname FROM hosts").scalars().all()
        assert sorted(names) == ["host-1", "host-2"]


def test_a_sqlite_uri_is_never_created_by_read_only_commands(tmp_path: Path) -> None:
    path = tmp_path / "typo3.db"
    for url in (f"sqlite:///file:{path}?uri=true", f"sqlite:///file:{path}?uri=true&cache=private"):
        unused = create_database(url, create=False)
        try:
            with pytest.raises(DatabaseError, match="unable to open"):
                current_revision(unused)
        finally:
            unused.dispose()
        assert not path.exists()
    # A mode the URL gives is kept; and creating one still works.
    made = create_database(f"sqlite:///file:{path}?uri=true")
    try:
        with made.begin_write() as conn:
            conn.exec_driver_sql("CREATE TABLE t (x)")
    finally:
        made.dispose()
    assert path.exists()
    read_only = create_database(f"sqlite:///file:{path}?mode=ro&uri=true", create=False)
    try:
        assert read_only.engine.url.query["mode"] == "ro"
        assert current_revision(read_only) is None  # opened, not migrated
    finally:
        read_only.dispose()
