"""Ingest writer: server CPU per stored snapshot, one push per transaction against pushes
stored together, side by side in one run and one process.

No HTTP: pushes go straight to the app's :class:`~gpuwatch.server.ingest.writer.IngestWriter`
(parse, token check, ingest, commit), so the figure is the part of a push that
batching can change. Each round, every host pushes one 8-GPU × 50-process snapshot
(bench/load.py's body) 15 s after its last, all at once, as a busy server sees them.
The two modes take turns, round by round, on two databases filled the same way;
``process_time`` counts every thread of this process, whose garbage collector is tuned
as ``gpuwatch server`` tunes its own (gpuwatch/server/runtime.py).

    .venv/bin/python -m bench.writer            # SQLite, then Postgres when reachable
    .venv/bin/python -m bench.writer --quick
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sqlalchemy import text

from bench.common import write_result
from bench.load import Template, batch_pieces
from gpuwatch.server.app import create_app
from gpuwatch.server.auth import service as auth_service
from gpuwatch.server.database import create_database
from gpuwatch.server.database.migrate import upgrade
from gpuwatch.server.deps import PushCredential
from gpuwatch.server.ingest.body import Deadline
from gpuwatch.server.ingest.writer import IngestWriter
from gpuwatch.server.runtime import tune_gc
from gpuwatch.settings import ServerSettings

POSTGRES_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
T0 = 1_700_000_000.0


class Side:
    """One database, app and writer; ``batch_seconds`` 0 stores one push a transaction."""

    def __init__(self, url: str, data_dir: Path, hosts: int, batch_seconds: float) -> None:
        self.now = T0
        self.database = create_database(url)
        upgrade(self.database)
        settings = ServerSettings(data_dir=data_dir, database_url=url, scheduler=False)
        app = create_app(settings, clock=lambda: self.now, engine=self.database.engine)
        self.writer = IngestWriter(
            app.state.gpuwatch,
            threads=1,
            batch_seconds=batch_seconds,
            linger_seconds=None if batch_seconds else 0.0,
        )
        tune_gc()  # as the server does once its app is built
        self.credentials = []
        with self.database.writer() as session, session.begin():
            for n in range(hosts):
                token = auth_service.create_token(session=session, hostname=f"h{n}", now=T0)
                digest = auth_service.token_digest(token)
                assert digest is not None
                identity = auth_service.identity_of_digest(session=session, digest=digest)
                assert identity is not None
                self.credentials.append(
                    PushCredential(identity=identity, token_sha256=digest, cached=True, client="")
                )

    async def round(self, template: Template, sequence: int) -> None:
        self.now = T0 + 15.0 * sequence
        pushes = []
        for credential in self.credentials:
            raw = bytearray(
                b"".join(
                    batch_pieces(template, credential.identity.hostname, [(sequence, self.now)])
                )
            )
            deadline = Deadline.after(3600, clock=time.monotonic)
            pushes.append(self.writer.store(raw, credential, deadline, True))
        for stored in await asyncio.gather(*pushes):
            assert stored.deferred == 0

    def close(self) -> None:
        self.writer.close()
        self.database.dispose()


def _reset_postgres() -> bool:
    try:
        database = create_database(POSTGRES_URL)
        with database.engine.begin() as conn:
            conn.execute(text("DROP SCHEMA public CASCADE"))
            conn.execute(text("CREATE SCHEMA public"))
        database.dispose()
    except Exception as err:  # no Postgres here: say so and go on
        print(f"   postgres skipped: {err}".splitlines()[0])
        return False
    return True


def bench_dialect(kind: str, tmp: Path, *, hosts: int, rounds: int, warm: int) -> dict[str, Any]:
    template = Template()
    modes = {"one_per_transaction": 0.0, "together": 0.1}
    if kind == "sqlite":
        sides = {mode: Side(f"sqlite:///{tmp / mode}.db", tmp / mode, hosts, seconds)
                 for mode, seconds in modes.items()}  # fmt: skip
    elif not _reset_postgres():
        return {"skipped": "Postgres unreachable"}
    cpu: dict[str, list[float]] = {mode: [] for mode in modes}
    wall: dict[str, list[float]] = {mode: [] for mode in cpu}

    async def run(side: Side, mode: str, sequence: int, measured: bool) -> None:
        began_cpu, began = time.process_time(), time.perf_counter()
        await side.round(template, sequence)
        if measured:
            cpu[mode].append((time.process_time() - began_cpu) / hosts)
            wall[mode].append((time.perf_counter() - began) / hosts)

    async def interleaved() -> None:
        for sequence in range(warm + rounds):
            for mode, side in sides.items():
                await run(side, mode, sequence, sequence >= warm)

    async def one_after_the_other() -> None:
        # Both sides on one schema would share rows: each runs on a fresh one.
        for n, (mode, seconds) in enumerate(modes.items()):
            if n:
                _reset_postgres()
            side = Side(POSTGRES_URL, tmp / mode, hosts, seconds)
            for sequence in range(warm + rounds):
                await run(side, mode, sequence, sequence >= warm)
            side.close()

    if kind == "sqlite":
        asyncio.run(interleaved())
        for side in sides.values():
            side.close()
    else:
        asyncio.run(one_after_the_other())
    result: dict[str, Any] = {"hosts": hosts, "rounds": rounds}
    for mode in cpu:
        result[mode] = {
            "cpu_ms_per_snapshot": round(1000 * statistics.median(cpu[mode]), 3),
            "wall_ms_per_snapshot": round(1000 * statistics.median(wall[mode]), 3),
        }
    result["cpu_ratio_together_to_one"] = round(
        result["together"]["cpu_ms_per_snapshot"]
        / result["one_per_transaction"]["cpu_ms_per_snapshot"],
        3,
    )
    return result


def main(argv: Sequence[str] = ()) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        prog="python -m bench.writer", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(list(argv))
    hosts, rounds, warm = (50, 4, 2) if args.quick else (200, 12, 4)
    result: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="gpuwatch-bench-writer-") as tmp_dir:
        for kind in ("sqlite", "postgres"):
            print(f"-- {kind}", flush=True)
            result[kind] = bench_dialect(kind, Path(tmp_dir), hosts=hosts, rounds=rounds, warm=warm)
            print(f"   {result[kind]}", flush=True)
    path = write_result("writer-quick" if args.quick else "writer", result)
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
