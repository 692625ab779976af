"""History read semantics: the GPU index of then, refused ranges, total orders, cursors
bound to their list. Queries run on both databases: same data, same answers."""

from __future__ import annotations

import base64
from typing import Any

import pytest
from sqlalchemy import Select, select, text
from sqlalchemy.orm import Session

from gpuwatch.server.database import create_database
from gpuwatch.server.database.migrate import upgrade
from gpuwatch.server.events.models import Event
from gpuwatch.server.hosts.models import Host
from gpuwatch.server.jobs import RETENTION_BATCH
from gpuwatch.server.processes.models import ProcessLifetime
from server.factories import T0, body, gpu, process, snapshot
from server.harness import Live

A = "GPU-aaaaaaaa-0000-0000-0000-000000000000"
B = "GPU-bbbbbbbb-0000-0000-0000-000000000000"


def _boot(seq: int, *, boot: str, index_a: int, index_b: int) -> Any:
    on_a = gpu(index_a, [process(111, user="alice", orphaned=True)], uuid=A)
    on_b = gpu(index_b, [process(222, user="bob", orphaned=True)], uuid=B)
    gpus = sorted([on_a, on_b], key=lambda g: g.index)
    return snapshot(seq, gpus, boot_id=boot, at=T0 + seq * 60)


def _get(live: Live, path: str, **params: Any) -> Any:
    response = live.client.get(path, params=params)
    assert response.status_code == 200, response.text
    return response.json()


def test_a_gpu_index_means_the_gpu_that_had_it_then(live: Live) -> None:
    # Boot 1: A is GPU 0 (alice), B is GPU 1 (bob). Boot 2 renumbers them (NVML's PCI
    # order changed), and the same processes are listed again, so their lifetimes reopen.
    token = live.token()
    live.push(token, body(*(_boot(s, boot="b1", index_a=0, index_b=1) for s in range(3))))
    live.push(token, body(*(_boot(s, boot="b2", index_a=1, index_b=0) for s in range(5, 8))))
    then, now = T0 + 60, T0 + 6 * 60

    def on_gpu0(at: float) -> list[tuple[str, int, str]]:
        found = _get(live, "/api/v1/processes", host="host-1", gpu=0, at=at)["items"]
        return [(p["user"], p["gpu_index"], p["gpu_uuid"]) for p in found]

    assert on_gpu0(then) == [("alice", 0, A)]
    assert on_gpu0(now) == [("bob", 0, B)]
    # Without a moment: whoever held GPU 0 at some time, newest first.
    listed = _get(live, "/api/v1/processes", host="host-1", gpu=0)["items"]
    assert {p["user"] for p in listed} == {"alice", "bob"}
    # /events files the same boot-1 condition under the same index.
    events = _get(live, "/api/v1/events", host="host-1", gpu=0, until=T0 + 120)["items"]
    assert {e["user"] for e in events} == {"alice"}


def test_top_idle_breaks_ties_by_user_the_same_on_both_databases(live: Live) -> None:
    live.token("host-1")
    _linguistic(live, "events", "user", 256)
    with live.database.writer() as session, session.begin():
        host_id = session.scalars(select(Host.id)).one()
        # Equal bytes for an equal time: only the tie-break orders them. "Mia" sorts
        # first bytewise (a linguistic collation would put it after "bob"); no user, last.
        held = {"zed": 1000, "amy": 1000, "Mia": 1000, "bob": 1000, None: 1000, "nil": 0}
        for n, (user, held_bytes) in enumerate(held.items()):
            session.add(_idle_event(host_id, n, user, held_bytes))

    ranked = _get(live, "/api/v1/events/top-idle", since=T0, until=T0 + 7200, limit=10)
    assert [r["user"] for r in ranked] == ["Mia", "amy", "bob", "zed", None]
    top = _get(live, "/api/v1/events/top-idle", since=T0, until=T0 + 7200, limit=2)
    assert [r["user"] for r in top] == ["Mia", "amy"]


def _idle_event(host_id: int, n: int, user: str | None, held_bytes: int) -> Event:
    return Event(
        kind="idle",
        reason="idle",
        host_id=host_id,
        dedup_key=f"idle:{n}",
        user=user,
        held_bytes=held_bytes,
        summary="idle",
        evidence={},
        started_at=T0 + 600,
        last_seen_at=T0 + 4200,
        ended_at=T0 + 4200,
    )


class TestRefused:
    """Requests with no meaningful answer are 422s, shaped like every other."""

    @pytest.fixture
    def database_url(self, sqlite_url: str) -> str:
        return sqlite_url

    @pytest.mark.parametrize(
        ("path", "params", "loc"),
        [
            ("/api/v1/events", {"since": T0, "until": T0 - 3600}, "until"),
            ("/api/v1/events/top-idle", {"since": T0, "until": T0 - 3600}, "until"),
            ("/api/v1/events/top-idle", {"since": T0 + 3600}, "until"),  # default: now
            ("/api/v1/processes/1/samples", {"since": 5, "until": 1}, "until"),
            ("/api/v1/events", {"since": "inf"}, "since"),
            ("/api/v1/events/top-idle", {"since": "1e400"}, "since"),
            ("/api/v1/processes/1/samples", {"until": "inf"}, "until"),
            ("/api/v1/processes", {"at": "inf"}, "at"),
        ],
    )
    def test_a_reversed_or_infinite_range_is_a_422_everywhere(
        self, live: Live, path: str, params: dict[str, Any], loc: str
    ) -> None:
        response = live.client.get(path, params=params)

        assert response.status_code == 422, response.text
        assert [e["loc"] for e in response.json()["detail"]] == [["query", loc]]

    def test_a_cursor_pages_only_its_own_list(self, live: Live) -> None:
        token = live.token()
        orphans = [gpu(0, [process(pid, orphaned=True) for pid in (1, 2, 3)])]
        live.push(token, body(snapshot(0, orphans)))
        events_cursor = _get(live, "/api/v1/events", limit=1)["next_cursor"]
        processes_cursor = _get(live, "/api/v1/processes", limit=1)["next_cursor"]
        assert _get(live, "/api/v1/events", limit=1, cursor=events_cursor)["items"]

        for path, cursor in (
            ("/api/v1/processes", events_cursor),
            ("/api/v1/events", processes_cursor),
            # Hand-made: Python's float() and int() take these, this server never wrote them.
            ("/api/v1/events", base64.urlsafe_b64encode(b"events: 1e9 :7").decode()),
            ("/api/v1/events", base64.urlsafe_b64encode(b"events:1_0:1_0").decode()),
        ):
            response = live.client.get(path, params={"cursor": cursor})
            assert response.status_code == 422, (path, response.text)


def _linguistic(live: Live, table: str, column: str, length: int) -> None:
    """On Postgres, give ``column`` a linguistic collation, as a database created with
    a locale such as en_US has (the test database is C.UTF-8): lists must not follow it."""
    if live.database.dialect != "postgresql":
        return
    with live.database.writer() as session, session.begin():
        session.execute(
            text(
                f'ALTER TABLE {table} ALTER COLUMN "{column}"'
                f' TYPE varchar({length}) COLLATE "en-x-icu"'
            )
        )


def test_hosts_are_listed_bytewise_whatever_the_database_locale(live: Live) -> None:
    _linguistic(live, "hosts", "hostname", 256)
    for name in ("host-a", "h5", "Host-A", "Alpha"):
        live.token(name)

    listed = [h["hostname"] for h in _get(live, "/api/v1/hosts")]

    assert listed == ["Alpha", "Host-A", "h5", "host-a"]


def test_retention_seeks_expired_rows_instead_of_scanning(database_url: str) -> None:
    database = create_database(database_url)
    upgrade(database)
    with database.reader() as session:
        for model in (Event, ProcessLifetime):
            expired = select(model.id).where(model.ended_at < T0).limit(RETENTION_BATCH)
            plan = _plan(session, expired)
            assert f"ix_{model.__tablename__}_ended_at" in plan, plan
    database.dispose()


def _plan(session: Session, query: Select[Any]) -> str:
    compiled = query.compile(session.get_bind(), compile_kwargs={"literal_binds": True})
    if session.get_bind().dialect.name == "sqlite":
        rows = session.execute(text(f"EXPLAIN QUERY PLAN {compiled}")).all()
        return " ".join(str(row[-1]) for row in rows)
    # Postgres plans a scan of a tiny table whatever its indexes: ask it not to.
    session.execute(text("SET LOCAL enable_seqscan = off"))
    return " ".join(row[0] for row in session.execute(text(f"EXPLAIN {compiled}")))
