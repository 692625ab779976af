"""Postgres page fill: the shipped ``fillfactor`` of the tables ingest rewrites on every
push (gpuwatch/server/database/core.py ``FILLFACTOR``) against Postgres's default (100),
side by side in one run and one process.

Two schemas on the same Postgres, each migrated to head; the default side then has its
tables reset to fillfactor 100. Each round, every host pushes one 8-GPU x 50-process
snapshot (bench/load.py's body) 15 s after its last, through the app's ingest writer
(bench/writer.py's ``Side``, no HTTP); the two sides take turns round by round. Reported
per side: this process's CPU a snapshot, every Postgres process's CPU a snapshot over
the same rounds (psutil), the share of row updates that were HOT (pg_stat_user_tables),
and the tables' size on disk.

    .venv/bin/python -m bench.fillfactor            # 150 hosts, 4 warm + 24 measured rounds
    .venv/bin/python -m bench.fillfactor --quick
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

import psutil
from sqlalchemy import create_engine, text

from bench.common import write_result
from bench.load import Template
from bench.server import postgres_unavailable
from bench.writer import POSTGRES_URL, Side
from gpuwatch.server.database.core import FILLFACTOR
from gpuwatch.server.ingest.writer import BATCH_SECONDS

SIDES = ("shipped", "default")


def postgres_cpu_seconds() -> float:
    """User and system CPU of every Postgres process now (backends, autovacuum, WAL)."""
    total = 0.0
    for process in psutil.process_iter(["name"]):
        if (process.info["name"] or "").startswith("postgres"):
            try:
                times = process.cpu_times()
            except psutil.Error:  # exited between the listing and the read
                continue
            total += times.user + times.system
    return total


def run(hosts: int, warm: int, rounds: int) -> dict[str, Any]:
    admin = create_engine(POSTGRES_URL, isolation_level="AUTOCOMMIT")
    schemas = {side: f"bench_fillfactor_{side}" for side in SIDES}
    with admin.connect() as conn:
        for schema in schemas.values():
            conn.execute(text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
            conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    template = Template()
    cpu: dict[str, list[float]] = {side: [] for side in SIDES}
    postgres: dict[str, list[float]] = {side: [] for side in SIDES}
    with tempfile.TemporaryDirectory(prefix="gpuwatch-bench-fillfactor-") as tmp:
        sides = {
            side: Side(
                f"{POSTGRES_URL}?options=-csearch_path%3D{schema}",
                Path(tmp) / side,
                hosts,
                BATCH_SECONDS,
            )
            for side, schema in schemas.items()
        }
        with admin.connect() as conn:
            for table in FILLFACTOR:
                conn.execute(text(f'ALTER TABLE "{schemas["default"]}".{table} RESET (fillfactor)'))

        async def rounds_in_turn() -> None:
            for sequence in range(warm + rounds):
                for side, writer in sides.items():
                    began_cpu, began_pg = time.process_time(), postgres_cpu_seconds()
                    await writer.round(template, sequence)
                    if sequence >= warm:
                        cpu[side].append((time.process_time() - began_cpu) / hosts)
                        postgres[side].append((postgres_cpu_seconds() - began_pg) / hosts)

        asyncio.run(rounds_in_turn())
        for writer in sides.values():
            writer.close()
    result: dict[str, Any] = {"hosts": hosts, "warm_rounds": warm, "rounds": rounds}
    with admin.connect() as conn:
        for side, schema in schemas.items():
            stats = conn.execute(
                text(
                    "SELECT relname, n_tup_upd, n_tup_hot_upd,"
                    " pg_total_relation_size(relid) FROM pg_stat_user_tables"
                    " WHERE schemaname = :schema"
                ),
                {"schema": schema},
            ).all()
            tables = {name: (updated, hot, size) for name, updated, hot, size in stats}
            result[side] = {
                "server_cpu_ms_per_snapshot": round(1000 * statistics.median(cpu[side]), 3),
                "postgres_cpu_ms_per_snapshot": round(1000 * statistics.median(postgres[side]), 3),
                "hot_update_share": {
                    name: round(tables[name][1] / tables[name][0], 3)
                    for name in FILLFACTOR
                    if tables[name][0]
                },
                "bytes_on_disk": {name: tables[name][2] for name in FILLFACTOR},
            }
            conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
    admin.dispose()
    shipped, default = result["shipped"], result["default"]
    for key in ("server_cpu_ms_per_snapshot", "postgres_cpu_ms_per_snapshot"):
        result[f"{key}_ratio_shipped_to_default"] = round(shipped[key] / default[key], 3)
    result["bytes_ratio_shipped_to_default"] = round(
        sum(shipped["bytes_on_disk"].values()) / sum(default["bytes_on_disk"].values()), 3
    )
    return result


def main(argv: Sequence[str] = ()) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        prog="python -m bench.fillfactor", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--quick", action="store_true", help="40 hosts, 8 measured rounds")
    args = parser.parse_args(list(argv))
    skipped = postgres_unavailable()
    if skipped:
        print(f"   skipped: {skipped}")
        return {"skipped": skipped}
    result = run(hosts=40, warm=2, rounds=8) if args.quick else run(hosts=150, warm=4, rounds=24)
    path = write_result("fillfactor-quick" if args.quick else "fillfactor", result)
    print(
        f"   Postgres CPU a snapshot: shipped/default "
        f"{result['postgres_cpu_ms_per_snapshot_ratio_shipped_to_default']}x, server "
        f"{result['server_cpu_ms_per_snapshot_ratio_shipped_to_default']}x, disk "
        f"{result['bytes_ratio_shipped_to_default']}x; wrote {path}"
    )
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
