"""The real central server for fault tests, and the agent's reporter pointed at it.

The server is the real app (``create_app``) under uvicorn on a real database, with
an injected clock; the reporter is the real one, with the same clock for its backoff
and its wall time, so "two hours of outage" takes as long as the test's requests do.
What the server stored is read back from ``snapshots_seen``, the table whose rows are
committed with everything derived from each snapshot.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import SecretStr
from server.conftest import POSTGRES_URL
from server.factories import gpu, process
from server.harness import make_token, serve
from sqlalchemy import create_engine, text
from support.clock import FakeClock

from gpuwatch.agent.reporter import Reporter, ReporterStats
from gpuwatch.server.app import create_app
from gpuwatch.server.database import Database, create_database
from gpuwatch.server.database.migrate import upgrade
from gpuwatch.settings import AgentSettings, ServerSettings
from gpuwatch.snapshot import HostSnapshot

T0 = 1_800_000_000.0
HOST = "host-1"
PUSH_INTERVAL = 15.0
Key = tuple[str, str, int]


@dataclass
class Central:
    url: str
    database: Database
    clock: FakeClock

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.url.removeprefix("http://").rsplit(":", 1)
        return host, int(port)

    def token(self, hostname: str = HOST) -> str:
        return make_token(self.database, hostname, self.clock())

    def stored(self) -> Counter[Key]:
        """Rows of ``snapshots_seen`` per key: a count above 1 is a duplicate stored.

        Read on a connection of its own, not one from the server's pool: a fault test
        may have killed a pooled session less than the pool's ping threshold before
        (database/core.py pings only connections idle longer), and the check must read
        what was stored, not meet the fault it injected."""
        engine = create_engine(self.database.engine.url)
        try:
            with engine.connect() as conn:
                rows = conn.execute(text("SELECT agent_id, boot_id, sequence FROM snapshots_seen"))
                return Counter((a, b, int(s)) for a, b, s in rows)
        finally:
            engine.dispose()

    def sequences(self) -> set[int]:
        return {key[2] for key in self.stored()}


@dataclass(frozen=True)
class PostgresSchema:
    """A fresh schema; :meth:`url` connects to it (through ``port``, if given), its
    sessions named ``application_name`` so a test can find and kill exactly them."""

    schema: str
    application_name: str

    def url(self, *, port: int = 5432) -> str:
        base = POSTGRES_URL.replace(":5432/", f":{port}/")
        return (
            f"{base}?options=-csearch_path%3D{self.schema}&application_name={self.application_name}"
        )

    def terminate_sessions(self) -> int:
        """``pg_terminate_backend`` on every session of this schema's server: what a
        Postgres restart does to them. Returns how many were killed."""
        admin = create_engine(POSTGRES_URL, isolation_level="AUTOCOMMIT")
        try:
            with admin.connect() as conn:
                killed = conn.execute(
                    text(
                        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
                        " WHERE application_name = :name AND pid <> pg_backend_pid()"
                    ),
                    {"name": self.application_name},
                ).scalar_one()
        finally:
            admin.dispose()
        return int(killed)


@contextmanager
def central(
    database_url: str,
    tmp_path: Path,
    clock: FakeClock,
    *,
    busy_timeout_seconds: float = 5.0,
    **settings: Any,
) -> Iterator[Central]:
    """A migrated database and the real server over it, on an ephemeral port."""
    database = create_database(database_url, sqlite_busy_timeout_seconds=busy_timeout_seconds)
    upgrade(database)
    values: dict[str, Any] = {
        "data_dir": tmp_path,
        "database_url": database_url,
        "scheduler": False,
        "agent_push_interval_seconds": PUSH_INTERVAL,
        **settings,
    }
    app = create_app(ServerSettings(**values), clock=clock, engine=database.engine)
    try:
        with serve(app) as url:
            yield Central(url=url, database=database, clock=clock)
    finally:
        database.dispose()


def reporter(
    server_url: str, token: str, spool_dir: Path, clock: FakeClock, *, max_bytes: int = 64 * 2**20
) -> Reporter:
    """The real reporter; ``clock`` serves as its monotonic and its wall clock, and
    the jitter is fixed at its middle so backoff is reproducible."""
    settings = AgentSettings(
        server_url=server_url,
        token=SecretStr(token),
        spool_dir=spool_dir,
        spool_max_bytes=max_bytes,
        push_interval_seconds=PUSH_INTERVAL,
    )
    return Reporter(settings, clock=clock, rand=lambda: 0.5, wall_clock=clock)


def host_snapshot(sequence: int, at: float, *, hostname: str = HOST) -> HostSnapshot:
    """One realistic poll (one A100, two processes), about 1.7 KB of JSON."""
    procs = [process(100, used_gib=4 + sequence % 3), process(200, used_gib=10)]
    return HostSnapshot(
        agent_id=f"agent-{hostname}",
        hostname=hostname,
        boot_id="boot-1",
        sequence=sequence,
        collected_at=at,
        driver_version="550.54.15",
        gpus=[gpu(0, procs)],
    )


def delivered(stats: ReporterStats) -> int:
    """Snapshots the server acknowledged, whatever it answered for each."""
    return sum(stats.pushed_total.values())


def dropped(stats: ReporterStats) -> int:
    return sum(stats.dropped_total.values())
