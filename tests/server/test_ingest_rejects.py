"""What ingest refuses, with which status, and that a refusal writes nothing; and what
it quarantines (valid, but refused by the database) so the agent drops it."""

from __future__ import annotations

import json
import logging
import socket
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import SecretStr
from sqlalchemy import func, select, text

from gpuwatch.agent.reporter import Reporter
from gpuwatch.server.app import create_app
from gpuwatch.server.auth import service as auth_service
from gpuwatch.server.auth.models import AgentToken
from gpuwatch.server.database import Database, create_database
from gpuwatch.server.database.migrate import upgrade
from gpuwatch.server.ingest.models import SnapshotSeen
from gpuwatch.settings import AgentSettings, ServerSettings
from server.factories import T0, body, gpu, process, snapshot
from server.harness import FakeClock, Live, make_token, serve


def stored(database: Database) -> int:
    with database.reader() as session:
        return session.scalar(select(func.count()).select_from(SnapshotSeen)) or 0


def one() -> dict[str, Any]:
    return body(snapshot(0, [gpu(0, [process(100)])]))


def _gpus(request: dict[str, Any]) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = request["snapshots"][0]["gpus"]
    return found


def _gpu(request: dict[str, Any]) -> dict[str, Any]:
    return _gpus(request)[0]


def _process(request: dict[str, Any]) -> dict[str, Any]:
    found: dict[str, Any] = _gpu(request)["processes"][0]
    return found


def _owner(request: dict[str, Any]) -> dict[str, Any]:
    found: dict[str, Any] = _process(request)["owner"]
    return found


class TestAuthentication:
    def test_missing_token_is_401_and_writes_nothing(self, live: Live) -> None:
        live.token("host-1")

        response = live.client.post("/api/v1/snapshots", json=one())

        assert response.status_code == 401
        assert response.headers["www-authenticate"] == "Bearer"
        assert stored(live.database) == 0

    @pytest.mark.parametrize("presented", ["gwt_not-a-real-token", "garbage", "gwt_" + "x" * 500])
    def test_unknown_token_is_403(self, live: Live, presented: str) -> None:
        live.token("host-1")

        assert live.push(presented, one()).status_code == 403
        assert stored(live.database) == 0

    def test_revoked_token_is_403(self, live: Live) -> None:
        token = live.token("host-1")
        with live.database.writer() as session, session.begin():
            auth_service.revoke_tokens(session=session, hostname="host-1", now=T0)

        assert live.push(token, one()).status_code == 403
        assert stored(live.database) == 0

    def test_token_of_another_host_is_403_even_for_one_item_of_a_batch(self, live: Live) -> None:
        token = live.token("host-1")
        live.token("host-2")
        mixed = body(
            snapshot(0, [gpu(0)], hostname="host-1"), snapshot(1, [gpu(0)], hostname="host-2")
        )

        response = live.push(token, mixed)

        assert response.status_code == 403
        assert "host-1" in response.json()["detail"]
        assert stored(live.database) == 0

    def test_tokens_never_reach_logs_or_the_database(
        self, live: Live, caplog: pytest.LogCaptureFixture
    ) -> None:
        caplog.set_level(logging.DEBUG)
        good = live.token("host-1")
        live.token("host-2")
        bad = "gwt_" + "s3cr3t" * 7

        live.push(bad, one())
        live.push(good, body(snapshot(0, [gpu(0)], hostname="host-2")))
        live.push(good, one())

        assert "refused agent request" in caplog.text  # the refusals were logged...
        assert good not in caplog.text and bad not in caplog.text  # ...without the tokens
        with live.database.reader() as session:
            hashes = session.scalars(select(AgentToken.token_sha256)).all()
        assert good not in hashes and auth_service.hash_token(good) in hashes


class TestValidation:
    """Refused before the database is touched, so SQLite alone is enough here."""

    @pytest.fixture
    def database_url(self, sqlite_url: str) -> str:
        return sqlite_url

    @pytest.mark.parametrize(
        "mutate",
        [
            pytest.param(lambda b: b.update(surprise=1), id="extra-top-level-field"),
            pytest.param(lambda b: b["snapshots"][0].update(surprise=1), id="extra-snapshot-field"),
            pytest.param(lambda b: b.update(snapshots=b["snapshots"] * 501), id="501-snapshots"),
            pytest.param(lambda b: b.update(snapshots=[]), id="no-snapshots"),
            pytest.param(
                lambda b: b["snapshots"][0].update(hostname="h" * 100_000), id="huge-string"
            ),
            pytest.param(
                lambda b: b["snapshots"][0]["gpus"][0].update(memory_used_bytes=-1),
                id="negative-memory",
            ),
            pytest.param(
                lambda b: b["snapshots"][0].update(collected_at=T0 + 86400), id="far-future"
            ),
            pytest.param(lambda b: b.update(spool_dropped_total=-5), id="negative-counter"),
            # Past the bounds the columns share (signed 64-bit, Linux uid_t).
            pytest.param(lambda b: b["snapshots"][0].update(sequence=2**63), id="sequence-2^63"),
            pytest.param(lambda b: _owner(b).update(uid=2**32), id="uid-2^32"),
            pytest.param(lambda b: _owner(b).update(uid=-1), id="uid-negative"),
            pytest.param(lambda b: _process(b).update(ppid=2**63), id="ppid-huge"),
            pytest.param(lambda b: _process(b).update(command="a\x00b"), id="nul-in-command"),
            pytest.param(lambda b: b["snapshots"][0].update(boot_id="\x00"), id="nul-in-key"),
            pytest.param(lambda b: _gpu(b).update(power_watts=float("inf")), id="infinity"),
            pytest.param(
                lambda b: _gpus(b).append(dict(_gpu(b), index=1, processes=[])), id="same-gpu-uuid"
            ),
            pytest.param(
                lambda b: _gpus(b).append(dict(_gpu(b), uuid="GPU-other", processes=[])),
                id="same-gpu-index",
            ),
        ],
    )
    def test_invalid_body_is_422_and_writes_nothing(self, live: Live, mutate: object) -> None:
        token = live.token("host-1")
        request = one()
        mutate(request)  # type: ignore[operator]

        # Not live.push: the server clock must stay put for the far-future case.
        response = live.client.post(
            "/api/v1/snapshots",
            content=json.dumps(request).encode(),  # infinity as the bare literal
            headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
        )

        assert response.status_code == 422, response.text
        assert stored(live.database) == 0

    @pytest.mark.parametrize(
        "raw", [b"{not json", b'{"snapshots": [NaN]}', b"[" * 100_000 + b"]" * 100_000]
    )
    def test_malformed_json_is_a_client_error(self, live: Live, raw: bytes) -> None:
        token = live.token("host-1")

        response = live.client.post(
            "/api/v1/snapshots",
            content=raw,
            headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
        )

        assert response.status_code in (400, 422), response.text
        assert stored(live.database) == 0


@pytest.fixture
def small_limit_server(tmp_path: Path, clock: FakeClock) -> Iterator[tuple[str, str, Database]]:
    database = create_database(f"sqlite:///{tmp_path / 'limit.db'}")
    upgrade(database)
    token = make_token(database, "host-1")
    settings = ServerSettings(data_dir=tmp_path, scheduler=False, max_body_bytes=64 * 1024)
    with serve(create_app(settings, clock=clock, engine=database.engine)) as url:
        yield url, token, database
    database.dispose()


class TestBodyLimit:
    def test_declared_oversized_body_is_413_without_being_sent(
        self, small_limit_server: tuple[str, str, Database]
    ) -> None:
        url, _, _ = small_limit_server
        host, port = url.removeprefix("http://").split(":")
        # Announce 100 MiB, send none of it: the answer must come from the header alone.
        with socket.create_connection((host, int(port)), timeout=5) as conn:
            conn.sendall(
                b"POST /api/v1/snapshots HTTP/1.1\r\nHost: localhost\r\n"
                b"Content-Type: application/json\r\nContent-Length: 104857600\r\n\r\n"
            )
            reply = conn.recv(4096)
        assert reply.startswith(b"HTTP/1.1 413")

    def test_streamed_oversized_body_is_413(
        self, small_limit_server: tuple[str, str, Database]
    ) -> None:
        url, token, database = small_limit_server

        def chunks() -> Iterator[bytes]:
            yield b'{"snapshots": ["'
            for _ in range(64):
                yield b"x" * 4096  # 256 KiB in all, no Content-Length (chunked)

        response = httpx.post(
            f"{url}/api/v1/snapshots",
            content=chunks(),
            headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
        )

        assert response.status_code == 413
        assert stored(database) == 0


class TestOutage:
    def test_postgres_down_is_503_with_retry_after(self, tmp_path: Path, clock: FakeClock) -> None:
        # Port 1: nothing listens there, so every connection is refused.
        database = create_database("postgresql+psycopg://postgres@127.0.0.1:1/test")
        settings = ServerSettings(data_dir=tmp_path, scheduler=False)
        with serve(create_app(settings, clock=clock, engine=database.engine)) as url:
            push = httpx.post(
                f"{url}/api/v1/snapshots",
                json=one(),
                headers={"Authorization": "Bearer gwt_whatever"},
            )
            health = httpx.get(f"{url}/healthz")
            metrics = httpx.get(f"{url}/metrics")
        assert push.status_code == 503
        assert push.headers["retry-after"] == "5"
        assert health.status_code == 503
        # The scrape still works, and says the database is down.
        assert metrics.status_code == 200
        assert "gpuwatch_server_database_up 0.0" in metrics.text

    def test_sqlite_write_lock_held_elsewhere_is_503(
        self, tmp_path: Path, clock: FakeClock
    ) -> None:
        path = tmp_path / "locked.db"
        database = create_database(f"sqlite:///{path}", sqlite_busy_timeout_seconds=0.2)
        upgrade(database)
        with database.writer() as session, session.begin():
            token = auth_service.create_token(session=session, hostname="host-1", now=T0)
        settings = ServerSettings(data_dir=tmp_path, scheduler=False)
        # Another process's long write transaction holds the only write lock.
        blocker = sqlite3.connect(path, isolation_level=None)
        blocker.execute("BEGIN IMMEDIATE")
        try:
            with serve(create_app(settings, clock=clock, engine=database.engine)) as url:
                response = httpx.post(
                    f"{url}/api/v1/snapshots",
                    json=one(),
                    headers={"Authorization": f"Bearer {token}"},
                )
        finally:
            blocker.rollback()
            blocker.close()
        assert response.status_code == 503
        assert stored(database) == 0
        with database.reader() as session:
            assert session.execute(text("PRAGMA journal_mode")).scalar() == "wal"
        database.dispose()


class TestQuarantine:
    """A valid batch the database refuses is answered 422 (type ``quarantined``), counted,
    and leads the agent to drop the one snapshot it cannot store, not retry it forever."""

    @staticmethod
    def poison_gpu_names(database: Database) -> None:
        # A constraint the schema does not know: what a bound it missed would look like.
        with database.begin_write() as conn:
            if conn.dialect.name == "sqlite":
                conn.exec_driver_sql(
                    "CREATE TRIGGER poison BEFORE INSERT ON gpus WHEN NEW.name = 'poison'"
                    " BEGIN SELECT RAISE(ABORT, 'poisoned'); END"
                )
            else:
                conn.exec_driver_sql(
                    "ALTER TABLE gpus ADD CONSTRAINT poison CHECK (name <> 'poison')"
                )

    def test_the_agent_drops_the_poison_snapshot_and_delivers_the_rest(
        self, live: Live, tmp_path: Path
    ) -> None:
        token = live.token("host-1")
        self.poison_gpu_names(live.database)
        sent = [
            snapshot(1, [gpu(0, [process(100)])]),
            snapshot(2, [gpu(0, [process(100)]), gpu(1, name="poison")]),
            snapshot(3, [gpu(0, [process(100, used_gib=7)])]),
        ]
        live.clock.now = sent[-1].collected_at
        alone = live.client.post(
            "/api/v1/snapshots", json=body(sent[1]), headers={"Authorization": f"Bearer {token}"}
        )
        reporter = Reporter(
            AgentSettings(
                server_url=live.url,
                token=SecretStr(token),
                spool_dir=tmp_path / "spool",
                push_interval_seconds=1,
            )
        )
        try:
            for each in sent:
                reporter.offer(each)
            drained = reporter.drain_once()
            stats = reporter.stats()
        finally:
            reporter.close()

        assert alone.status_code == 422
        (error,) = alone.json()["detail"]
        assert (error["type"], error["loc"]) == ("quarantined", ["body"])
        assert drained.stopped_by is None and drained.pending == 0
        assert stats.pushed_total == {"accepted": 2, "duplicate": 0}
        assert stats.dropped_total == {"rejected": 1}
        assert stored(live.database) == 2
        # [1, 2, 3] and then [2, 3] and [2] alone were refused; the one above as well.
        metrics = live.client.get("/metrics").text
        assert 'gpuwatch_server_ingest_requests_total{result="quarantined"} 4.0' in metrics
