"""What ingest keeps for the fleet page: each GPU's open events as a flag mask on its row
(``gpus.open_flags``, bit ``i``: an open ``GPU_FLAG_KINDS[i]`` event on the GPU's host
and index), and each host's tiles (``hosts.tiles``, JSON: hosts/tiles.py). They must
say what the open events and the GPU rows say after every kind of change: events
opening and closing as processes die, idle and exit, a GPU lost and read again, a host
gone silent (the stale-lifetime job), a migration from before the columns. Each step
is checked against the events and rows themselves, combined here independently."""

from __future__ import annotations

import json
from typing import Any

from alembic import command
from sqlalchemy import text

from gpuwatch.server.database import Database, create_database
from gpuwatch.server.database.migrate import alembic_config, head_revision, upgrade
from gpuwatch.server.hosts.models import GPU_FLAG_KINDS
from gpuwatch.server.ingest.cache import HostStateCache
from gpuwatch.server.jobs import close_stale_lifetimes
from gpuwatch.settings import ServerSettings
from gpuwatch.snapshot import Gpu, GpuProcess
from server.factories import T0, gpu, process
from server.test_gpu_holders import at, insert_host_with_gpus, push

MIB = 2**20
ORPHANED, IDLE, LOST = (1 << GPU_FLAG_KINDS.index(k) for k in ("orphaned", "idle", "gpu_lost"))


def stored(database: Database) -> dict[int, int]:
    """GPU index -> the flag mask on its row."""
    with database.reader() as session:
        return dict(session.execute(text("SELECT gpu_index, open_flags FROM gpus")).all())


def from_events(database: Database) -> dict[int, int]:
    """GPU index -> the mask the open events on it make."""
    with database.reader() as session:
        indexes = session.scalars(text("SELECT gpu_index FROM gpus")).all()
        open_events = session.execute(
            text("SELECT gpu_index, kind FROM events WHERE ended_at IS NULL")
        ).all()
    out = dict.fromkeys(indexes, 0)
    for index, kind in open_events:
        if index in out and kind in GPU_FLAG_KINDS:
            out[index] |= 1 << GPU_FLAG_KINDS.index(kind)
    return out


def tiles_from_rows(database: Database) -> dict[str, list[list[Any]]]:
    """Hostname -> its tiles as the GPU rows say: by index, a lost GPU unread."""
    with database.reader() as session:
        rows = session.execute(
            text(
                "SELECT h.hostname, g.gpu_index, g.memory_total_bytes, g.memory_used_bytes,"
                " g.lost, g.holder_bytes, g.holder_processes, g.holder_users, g.holder_user,"
                " g.open_flags FROM gpus g JOIN hosts h ON h.id = g.host_id"
                " ORDER BY h.hostname, g.gpu_index"
            )
        ).all()
    out: dict[str, list[list[Any]]] = {}
    for host, index, total, used, lost, largest, processes, users, user, mask in rows:
        used = None if lost else used
        percent = None if used is None or not total else used * 100 // total
        mib = [None if v is None else v // MIB for v in (used, total)]
        tile = [index, percent, *mib, (largest or 0) // MIB, processes, users, user, mask]
        out.setdefault(host, []).append(tile)
    return out


def flags(database: Database) -> dict[int, int]:
    """The stored masks, having checked that the open events agree, and that each
    host's tiles say what its GPU rows say."""
    kept = stored(database)
    assert kept == from_events(database)
    with database.reader() as session:
        texts = dict(session.execute(text("SELECT hostname, tiles FROM hosts")).all())
    assert {host: json.loads(tiles) for host, tiles in texts.items()} == tiles_from_rows(database)
    return kept


def ghost(pid: int) -> GpuProcess:
    return process(pid, used_gib=2, sm=0.0, alive=False, orphaned=True, user="ghost")


def fleet(seq: int, *, ghosts: bool = True, lost: bool = False) -> list[Gpu]:
    """GPU 0: a dead process still holding memory beside a busy one; GPU 1: dave
    computing nothing (idle after the idle window); GPU 2: busy."""
    busy = process(12, used_gib=8, sm=0.9, user="carol")
    return [
        gpu(0, [ghost(10), busy] if ghosts else [busy]),
        gpu(1, [process(21, used_gib=10, sm=0.0, user="dave")], lost=lost),
        gpu(2, [process(30, used_gib=4, sm=0.9, user="erin")]),
    ]


def test_flags_follow_events_as_they_open_and_close(
    database: Database, settings: ServerSettings
) -> None:
    cache = HostStateCache(8)  # as the server keeps host state between pushes
    push(database, settings, at(0, fleet(0)), cache=cache)
    assert flags(database) == {0: ORPHANED, 1: 0, 2: 0}

    # Eleven minutes at 15 s: past the 600 s idle window, dave's process is idle.
    for seq in range(1, 45):
        push(database, settings, at(seq, fleet(seq)), cache=cache)
    assert flags(database) == {0: ORPHANED, 1: IDLE, 2: 0}

    push(database, settings, at(45, fleet(45, ghosts=False)), cache=cache)  # the ghost exits
    assert flags(database)[0] == 0

    # A lost GPU is flagged lost (and, unread, its process's idle event stays open).
    push(database, settings, at(46, fleet(46, ghosts=False, lost=True)), cache=cache)
    lost_flags = flags(database)[1]
    assert lost_flags & LOST

    push(database, settings, at(47, fleet(47, ghosts=False)), cache=cache)  # read again
    assert not flags(database)[1] & LOST


def test_the_stale_lifetime_job_clears_the_flags_of_what_it_closes(
    database: Database, settings: ServerSettings
) -> None:
    cache = HostStateCache(8)
    push(database, settings, at(0, fleet(0)), cache=cache)
    assert flags(database)[0] == ORPHANED

    assert close_stale_lifetimes(database=database, settings=settings, now=T0 + 600) >= 1
    assert flags(database) == {0: 0, 1: 0, 2: 0}

    push(database, settings, at(60, fleet(60)), cache=cache)  # the agent returns
    assert flags(database)[0] == ORPHANED


BEFORE_FLAGS = "a9d4e6b2c718"


def test_the_migration_fills_flags_from_the_open_events(database_url: str) -> None:
    database = create_database(database_url)
    upgrade(database, BEFORE_FLAGS)
    events = [  # kind, GPU index, ended
        ("orphaned", 0, None),
        ("orphaned", 0, None),  # two on one GPU: one bit
        ("idle", 0, None),
        ("idle", 1, 10.0),  # closed: no flag
        ("runaway", 1, None),
        ("agent_silent", None, None),  # about the host: no GPU's flag
        ("gpu_back", 2, 5.0),
    ]
    with database.begin_write() as conn:
        insert_host_with_gpus(conn, 3)
        for n, (kind, index, ended) in enumerate(events):
            conn.execute(
                text(
                    "INSERT INTO events (host_id, kind, reason, dedup_key, gpu_index, summary,"
                    " evidence, started_at, last_seen_at, ended_at)"
                    " VALUES (1, :kind, :kind, :key, :index, '', '{}', 0, 0, :ended)"
                ),
                {"kind": kind, "key": f"k{n}", "index": index, "ended": ended},
            )

    upgrade(database)

    runaway = 1 << GPU_FLAG_KINDS.index("runaway")
    assert flags(database) == {0: ORPHANED | IDLE, 1: runaway, 2: 0}
    with database.begin_write() as conn:
        command.downgrade(alembic_config(conn), BEFORE_FLAGS)
        command.upgrade(alembic_config(conn), head_revision())
    assert flags(database)[0] == ORPHANED | IDLE
    database.dispose()
