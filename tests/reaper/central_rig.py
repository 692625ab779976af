"""A live central server for the reaper's tests: uvicorn over real SQLite, fed by the
ingest API (``reaper.central_rig``). The fixture ``central`` is in conftest.py."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
from server.harness import make_token, serve

from gpuwatch.server.app import create_app
from gpuwatch.server.database import Database, create_database
from gpuwatch.server.database.migrate import upgrade
from gpuwatch.settings import ServerSettings
from gpuwatch.snapshot import HostSnapshot
from gpuwatch.wire import ingest_request_json

READ_TOKEN = "reader-secret"
STEP = 30.0  # the stand-in agent polls and pushes every 30 s


@dataclass
class Central:
    url: str
    token: str
    database: Database

    def push(self, snapshots: list[HostSnapshot]) -> None:
        for i in range(0, len(snapshots), 500):
            batch = [s.model_dump_json().encode() for s in snapshots[i : i + 500]]
            answer = httpx.post(
                f"{self.url}/api/v1/snapshots",
                content=ingest_request_json(batch, 0),
                headers={
                    "Authorization": f"Bearer {self.token}",
                    "Content-Type": "application/json",
                },
                timeout=60,
            )
            assert answer.status_code == 200, answer.text

    def reaped_pids(self) -> list[int]:
        events = httpx.get(
            f"{self.url}/api/v1/events",
            params={"kind": "reaped"},
            headers={"Authorization": f"Bearer {READ_TOKEN}"},
        ).json()["items"]
        return [e["pid"] for e in events]


def central_fixture(tmp_path: Path) -> Iterator[Central]:
    database = create_database(f"sqlite:///{tmp_path / 'server.db'}")
    upgrade(database)
    settings = ServerSettings(
        data_dir=tmp_path / "server",
        scheduler=False,
        read_token=READ_TOKEN,
        sample_interval_seconds=60,
        agent_push_interval_seconds=STEP,
    )
    token = make_token(database, socket.gethostname(), time.time())
    with serve(create_app(settings, engine=database.engine)) as url:
        yield Central(url, token, database)
    database.dispose()
