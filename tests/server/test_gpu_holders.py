"""Each GPU's holders kept on its row (``gpus.holder_*``): the owner of the largest open
lifetime and its bytes, how many open lifetimes and distinct users. They must say what
the open lifetimes say after every kind of change to them: a process exiting or
growing, a GPU lost and read again, a host gone silent (the stale-lifetime job) and
back, a reboot, a process seen on another GPU. Each step is checked against the
lifetimes themselves, summarised here independently (sorted, not in one pass)."""

from __future__ import annotations

from typing import Any

from alembic import command
from sqlalchemy import Connection, text

from gpuwatch.server.database import Database, create_database
from gpuwatch.server.database.migrate import alembic_config, head_revision, upgrade
from gpuwatch.server.ingest.cache import HostStateCache
from gpuwatch.server.ingest.service import ingest_snapshots
from gpuwatch.server.jobs import close_stale_lifetimes
from gpuwatch.settings import ServerSettings
from gpuwatch.snapshot import Gpu, HostSnapshot
from gpuwatch.wire import IngestRequest
from server.factories import GIB, T0, gpu, process, snapshot
from server.harness import make_token

Holders = tuple[str | None, int | None, int, int]
NOBODY: Holders = (None, None, 0, 0)


def push(
    database: Database,
    settings: ServerSettings,
    *snaps: HostSnapshot,
    cache: HostStateCache | None = None,
) -> None:
    """Ingest as the server does, keeping the host's state in ``cache`` between pushes."""
    host = snaps[0].hostname
    with database.reader() as session:
        host_id = session.scalar(text("SELECT id FROM hosts WHERE hostname = :h"), {"h": host})
    if host_id is None:
        make_token(database, host)
        with database.reader() as session:
            host_id = session.scalar(text("SELECT id FROM hosts WHERE hostname = :h"), {"h": host})
    with database.writer() as session, session.begin():
        result = ingest_snapshots(
            session=session,
            dialect=database.dialect,
            host_id=host_id,
            request=IngestRequest(snapshots=list(snaps)),
            settings=settings,
            now=max(s.collected_at for s in snaps),
            cache=cache,
        )
    if cache is not None and result.kept is not None:
        cache.put(host_id, result.kept)


def stored(database: Database) -> dict[int, Holders]:
    """GPU index -> the holders on its row."""
    with database.reader() as session:
        rows = session.execute(
            text(
                "SELECT gpu_index, holder_user, holder_bytes, holder_processes, holder_users"
                " FROM gpus"
            )
        ).all()
    return {index: (user, size, count, users) for index, user, size, count, users in rows}


def from_lifetimes(database: Database) -> dict[int, Holders]:
    """GPU index -> the holders as the open lifetimes say: sorted by bytes (unknown
    last), then age; distinct users without the unknown one."""
    with database.reader() as session:
        gpus = dict(session.execute(text("SELECT id, gpu_index FROM gpus")).all())
        open_rows = session.execute(
            text(
                'SELECT gpu_id, id, "user", current_bytes FROM process_lifetimes'
                " WHERE ended_at IS NULL"
            )
        ).all()
    out = dict.fromkeys(gpus.values(), NOBODY)
    for gpu_id, index in gpus.items():
        rows = sorted(
            (r for r in open_rows if r[0] == gpu_id),
            key=lambda r: (r[3] is None, -(r[3] or 0), r[1]),
        )
        if rows:
            users = {r[2] for r in rows if r[2] is not None}
            out[index] = (rows[0][2], rows[0][3], len(rows), len(users))
    return out


def holders(database: Database) -> dict[int, Holders]:
    """The stored holders, having checked that the open lifetimes agree."""
    kept = stored(database)
    assert kept == from_lifetimes(database)
    return kept


def at(seq: int, gpus: list[Gpu], **kwargs: Any) -> HostSnapshot:
    return snapshot(seq, gpus, hostname="h1", **kwargs)


def test_holders_follow_processes_as_they_start_grow_and_exit(
    database: Database, settings: ServerSettings
) -> None:
    alice, bob, alice2 = (
        process(1, used_gib=4, user="alice"),
        process(2, used_gib=9, user="bob"),
        process(3, used_gib=2, user="alice"),
    )
    push(database, settings, at(0, [gpu(0, [alice, bob, alice2]), gpu(1, [])]))
    assert holders(database) == {0: ("bob", 9 * GIB, 3, 2), 1: NOBODY}

    grown = process(3, used_gib=12, user="alice")
    push(database, settings, at(1, [gpu(0, [alice, bob, grown]), gpu(1, [])]))
    assert holders(database)[0] == ("alice", 12 * GIB, 3, 2)

    push(database, settings, at(2, [gpu(0, [alice]), gpu(1, [])]))  # bob's and pid 3 exit
    assert holders(database)[0] == ("alice", 4 * GIB, 1, 1)

    push(database, settings, at(3, [gpu(0, []), gpu(1, [])]))
    assert holders(database) == {0: NOBODY, 1: NOBODY}


def test_a_tie_names_the_oldest_lifetime_and_unknowns_count_least(
    database: Database, settings: ServerSettings
) -> None:
    dave, carol = process(4, used_gib=6, user="dave"), process(5, used_gib=6, user="carol")
    unknown = process(6, user="erin").model_copy(update={"used_bytes": None})
    nameless = process(7).model_copy(
        update={"used_bytes": None, "owner": process(7).owner.model_copy(update={"user": None})}
    )
    push(database, settings, at(0, [gpu(0, [dave]), gpu(1, [nameless])]))
    # carol is listed first, with as much as dave: dave's lifetime is the older.
    push(database, settings, at(1, [gpu(0, [unknown, carol, dave]), gpu(1, [nameless])]))
    assert holders(database) == {0: ("dave", 6 * GIB, 3, 3), 1: (None, None, 1, 0)}


def test_a_lost_gpu_keeps_its_holders_until_it_is_read_again(
    database: Database, settings: ServerSettings
) -> None:
    bob = process(2, used_gib=9, user="bob")
    push(database, settings, at(0, [gpu(0, [bob]), gpu(1, [process(3, user="carol")])]))
    # A lost GPU says nothing about its processes: their lifetimes stay open, and so do
    # its holders; GPU 1 missing from a snapshot is the same.
    push(database, settings, at(1, [gpu(0, [], lost=True)]))
    assert holders(database) == {0: ("bob", 9 * GIB, 1, 1), 1: ("carol", 4 * GIB, 1, 1)}

    push(database, settings, at(2, [gpu(0, []), gpu(1, [process(3, user="carol")])]))
    assert holders(database) == {0: NOBODY, 1: ("carol", 4 * GIB, 1, 1)}


def test_a_silent_host_loses_its_holders_and_gets_them_back(
    database: Database, settings: ServerSettings
) -> None:
    cache = HostStateCache(8)  # as the server keeps host state between pushes
    bob = process(2, used_gib=9, user="bob")
    push(database, settings, at(0, [gpu(0, [bob])]), cache=cache)

    assert close_stale_lifetimes(database=database, settings=settings, now=T0 + 600) == 1
    assert holders(database) == {0: NOBODY}

    # The agent returns: bob's process (same start time) reopens its lifetime, and the
    # copy of the host's state kept from before the job is not used.
    push(database, settings, at(60, [gpu(0, [bob, process(3, user="erin")])]), cache=cache)
    assert holders(database) == {0: ("bob", 9 * GIB, 2, 2)}

    # A reboot ends every lifetime; only what the new boot lists holds memory.
    rebooted = process(3, used_gib=1, user="erin", start_time=T0 + 910)
    push(database, settings, at(61, [gpu(0, [rebooted])], boot_id="boot-2"))
    assert holders(database) == {0: ("erin", 1 * GIB, 1, 1)}


def test_a_process_seen_on_another_gpu_moves_its_holder(
    database: Database, settings: ServerSettings
) -> None:
    erin = process(7, used_gib=5, user="erin")
    push(database, settings, at(0, [gpu(0, [erin]), gpu(1, [])]))
    push(database, settings, at(1, [gpu(0, []), gpu(1, [erin])]))
    assert holders(database) == {0: NOBODY, 1: ("erin", 5 * GIB, 1, 1)}

    # Indexes renumbered (a reboot can): holders belong to the physical GPU, its UUID,
    # and its tile shows them at its new index.
    swapped = [
        gpu(0, [erin], uuid=gpu(1).uuid),
        gpu(1, [process(8, user="finn")], uuid=gpu(0).uuid),
    ]
    push(database, settings, at(2, swapped))
    assert holders(database) == {0: ("erin", 5 * GIB, 1, 1), 1: ("finn", 4 * GIB, 1, 1)}


BEFORE_HOLDERS = "f3c8a2d6b154"


def insert_host_with_gpus(conn: Connection, gpus: int) -> None:
    """Host 1 and its GPUs 1..``gpus`` (index = id - 1), in SQL: for a schema older
    than the code's models."""
    conn.execute(
        text(
            "INSERT INTO hosts (id, hostname, created_at, pid_namespace_isolated, fake,"
            " spool_dropped_total) VALUES (1, 'host-1', 0, false, false, 0)"
        )
    )
    for gpu_id in range(1, gpus + 1):
        conn.execute(
            text(
                "INSERT INTO gpus (id, host_id, uuid, gpu_index, lost, last_seen_at)"
                " VALUES (:id, 1, :uuid, :index, false, 0)"
            ),
            {"id": gpu_id, "uuid": f"GPU-{gpu_id}", "index": gpu_id - 1},
        )


def test_the_migration_fills_holders_from_the_open_lifetimes(database_url: str) -> None:
    database = create_database(database_url)
    upgrade(database, BEFORE_HOLDERS)
    lifetimes = [  # id, gpu, user, bytes, ended
        (1, 1, "alice", 4 * GIB, None),
        (2, 1, "bob", 9 * GIB, None),
        (3, 1, "carol", 9 * GIB, None),  # ties bob: bob's lifetime is older
        (4, 1, "alice", 2 * GIB, None),
        (5, 1, "zed", 50 * GIB, 10.0),  # closed: not a holder
        (6, 2, None, None, None),
        (7, 3, "zed", 1 * GIB, 10.0),
    ]
    with database.begin_write() as conn:
        insert_host_with_gpus(conn, 3)
        for lifetime_id, gpu_id, user, size, ended in lifetimes:
            conn.execute(
                text(
                    "INSERT INTO process_lifetimes (id, host_id, gpu_id, pid, kind, orphaned,"
                    ' first_seen_at, last_seen_at, ended_at, "user", current_bytes)'
                    " VALUES (:id, 1, :gpu, :id, 'compute', false, 0, 0, :ended, :user, :size)"
                ),
                {"id": lifetime_id, "gpu": gpu_id, "user": user, "size": size, "ended": ended},
            )

    upgrade(database)

    assert holders(database) == {0: ("bob", 9 * GIB, 4, 3), 1: (None, None, 1, 0), 2: NOBODY}
    with database.begin_write() as conn:
        command.downgrade(alembic_config(conn), BEFORE_HOLDERS)
        command.upgrade(alembic_config(conn), head_revision())
    assert holders(database)[0] == ("bob", 9 * GIB, 4, 3)
    database.dispose()
