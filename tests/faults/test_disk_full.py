"""Disk full: under the agent's spool, and under the server's SQLite database.

Each runs on a small tmpfs of its own (root only: ``small_disk``), filled with a filler
file until the kernel answers ENOSPC, with the real spool, reporter and server on
it. The promise: a full disk is an outage, never damage. The agent counts what it
could not spool (``write_failed``) and keeps every record it had; the server answers
503 (never 500) and its database stays intact (``PRAGMA integrity_check``); when the
space comes back both carry on and nothing else is lost or stored twice.
"""

from __future__ import annotations

import errno
import logging
import os
import sqlite3
from collections.abc import Callable
from pathlib import Path

import pytest
from server.factories import big_host
from support.clock import FakeClock

from faults.central import T0, central, delivered, dropped, host_snapshot, reporter
from faults.proxy import proxy_to
from gpuwatch.agent.spool import Spool
from gpuwatch.snapshot import HostSnapshot

SmallDisk = Callable[[str, str], Path]


def fill(directory: Path, *, leave: int = 0) -> Path:
    """Write a filler file until the filesystem under ``directory`` is full (or has
    only ``leave`` bytes free); the caller deletes it to give the space back."""
    filler = directory / "filler"
    chunk = b"\0" * 4096
    with filler.open("wb") as f:
        while True:
            stats = os.statvfs(directory)
            if stats.f_bavail * stats.f_frsize <= leave:
                break
            try:
                f.write(chunk)
                f.flush()
            except OSError as err:
                assert err.errno == errno.ENOSPC
                break
    return filler


def padded(sequence: int, at: float) -> HostSnapshot:
    """A poll of about 12 KB: three more processes with 4 KB command lines."""
    data = host_snapshot(sequence, at).model_dump()
    template = data["gpus"][0]["processes"][0]
    for pid in (300, 301, 302):
        data["gpus"][0]["processes"].append({**template, "pid": pid, "command": "x" * 4000})
    return HostSnapshot.model_validate(data)


def test_a_full_disk_under_the_spool_counts_the_loss_and_damages_nothing(
    small_disk: SmallDisk, tmp_path: Path
) -> None:
    spool_dir = small_disk("spool", "1m")
    clock = FakeClock(T0)
    with (
        central(f"sqlite:///{tmp_path / 'central.db'}", tmp_path, clock) as server,
        proxy_to(server.address, up=False) as proxy,  # the server is away meanwhile
    ):
        agent = reporter(f"http://127.0.0.1:{proxy.port}", server.token(), spool_dir, clock)
        try:
            filler = fill(spool_dir, leave=48 * 1024)
            # ~12 KB polls into ~48 KB: a few fit, one is cut short by ENOSPC mid-write.
            for sequence in range(12):
                agent.offer(padded(sequence, clock()))
                agent.drain_once()
                clock.advance(15)
            full = agent.stats()
            leftovers = sorted(p.name for p in spool_dir.iterdir() if p.name != "filler")
            # The spool as a restarted agent would find it: every record readable.
            reopened = Spool(spool_dir, max_bytes=2**30)
            batch = reopened.peek_batch(1000, 2**30)
            reopened.release(batch)
            readable = [HostSnapshot.model_validate_json(r.body).sequence for r in batch]

            filler.unlink()  # space comes back
            for sequence in range(12, 16):
                agent.offer(padded(sequence, clock()))
                clock.advance(15)
            proxy.up()
            for _ in range(10):
                result = agent.drain_once()
                if result.stopped_by is None:
                    break
                clock.advance(result.retry_in_seconds or 1)
            stats = agent.stats()
        finally:
            agent.close()
        stored = server.stored()

    spooled = full.pending
    assert 0 < spooled < 12
    assert full.dropped_total == {"spool_full": 12 - spooled}
    assert not [name for name in leftovers if name.endswith(".tmp")]  # no torn write left
    assert readable == list(range(12 - spooled, 12)) and reopened.dropped() == {}
    assert stats.pending == 0
    assert delivered(stats) + dropped(stats) == 16
    assert delivered(stats) == spooled + 4
    assert sorted(k[2] for k in stored) == [*range(12 - spooled, 12), 12, 13, 14, 15]
    assert max(stored.values()) == 1


def test_a_full_disk_under_the_database_is_503_and_never_corrupts_it(
    small_disk: SmallDisk, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    data = small_disk("data", "8m")
    db = data / "central.db"
    clock = FakeClock(T0)
    with central(f"sqlite:///{db}", tmp_path, clock, busy_timeout_seconds=1) as server:
        agent = reporter(server.url, server.token(), tmp_path / "spool", clock)
        statuses: list[str | None] = []
        try:
            sequence = 0

            def poll() -> None:
                nonlocal sequence
                snap = big_host(sequence)  # 8 GPUs, 50 processes: rows on every table
                agent.offer(snap.model_copy(update={"collected_at": clock()}))
                sequence += 1
                clock.advance(15)

            poll()
            assert agent.drain_once().stopped_by is None
            filler = fill(data)
            # WAL pages already on disk absorb a few commits; push until one needs more.
            for _ in range(60):
                poll()
                result = agent.drain_once()
                statuses.append(result.stopped_by)
                if result.stopped_by is not None:
                    break
                clock.advance(15)
            during = integrity(db)

            filler.unlink()
            for _ in range(10):
                clock.advance(60)
                if agent.drain_once().stopped_by is None:
                    break
            stats = agent.stats()
        finally:
            agent.close()
        stored = server.stored()

    assert statuses[-1] == "throttled", f"the disk never filled: {statuses}"
    assert during == "ok" and integrity(db) == "ok"
    assert stats.pending == 0 and stats.dropped_total == {}
    assert delivered(stats) == sequence
    assert sorted(k[2] for k in stored) == list(range(sequence))
    assert max(stored.values()) == 1
    assert "server_error" not in stats.batches_total
    errors = [
        r.getMessage()
        for r in caplog.records
        if r.name.startswith("gpuwatch.server") and r.levelno >= logging.ERROR
    ]
    assert errors == []


def integrity(db: Path) -> str:
    with sqlite3.connect(db) as conn:
        return str(conn.execute("PRAGMA integrity_check").fetchone()[0])
