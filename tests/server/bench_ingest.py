"""End-to-end ingest throughput: `gpuwatch server` (subprocess) <- HTTP <- this client.

Not a test (no threshold on a shared machine); run it by hand::

    .venv/bin/python tests/server/bench_ingest.py [--count 600] [--batch 1 --batch 50]

Each snapshot is 8 GPUs and 50 processes (performance-anchors.md G4b's shape). Bodies
are serialised before the clock starts, so the figure is the server's.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpuwatch.server.auth import service as auth_service
from gpuwatch.server.database import create_database
from gpuwatch.server.database.migrate import upgrade
from server.factories import big_host


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=600, help="snapshots per run")
    parser.add_argument("--batch", type=int, action="append", help="snapshots per request")
    parser.add_argument("--database-url", help="default: a fresh SQLite file")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        url = args.database_url or f"sqlite:///{tmp}/bench.db"
        database = create_database(url)
        upgrade(database)
        for batch in args.batch or [1, 50]:
            host = f"bench-{batch}"
            with database.writer() as session:
                token = auth_service.create_token(session=session, hostname=host, now=time.time())
                session.commit()
            rate = run(url, tmp, token, host, count=args.count, batch=batch)
            print(f"batch={batch:>3}: {rate:7.0f} snapshots/s ({args.count} snapshots)")
        database.dispose()


def run(url: str, tmp: str, token: str, host: str, *, count: int, batch: int) -> float:
    start_at = time.time() - count * 15
    bodies = []
    for first in range(0, count, batch):
        snaps = []
        for seq in range(first, min(first + batch, count)):
            snap = big_host(seq, hostname=host)
            snap.collected_at = start_at + seq * 15
            snaps.append(snap.model_dump(mode="json"))
        bodies.append(json.dumps({"snapshots": snaps}).encode())
    env = {
        **os.environ,
        "GPUWATCH_CONFIG": "/nonexistent",
        "GPUWATCH_SERVER_DATABASE_URL": url,
        "GPUWATCH_SERVER_SCHEDULER": "false",
        "GPUWATCH_SERVER_DATA_DIR": tmp,
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpuwatch", "server", "--listen", "127.0.0.1:0"],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stderr is not None
    match = re.search(r"(http://\S+)", proc.stderr.readline())
    assert match
    base = match.group(1)
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    try:
        with httpx.Client(base_url=base, headers=headers, timeout=60) as client:
            _wait(client)
            began = time.perf_counter()
            for data in bodies:
                response = client.post("/api/v1/snapshots", content=data)
                response.raise_for_status()
            elapsed = time.perf_counter() - began
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        proc.stderr.close()
    return count / elapsed


def _wait(client: httpx.Client) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if client.get("/healthz").status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.05)
    raise RuntimeError("server did not come up")


if __name__ == "__main__":
    main()
