"""The migrations of recent windows: the move out of process_lifetimes keeps them, both
ways; the change of record format (peaks added) drops the old blobs rather than
misread them."""

from __future__ import annotations

from alembic import command
from sqlalchemy import inspect, text

from gpuwatch.server.database import create_database
from gpuwatch.server.database.migrate import alembic_config, upgrade

BEFORE = "93cfd2d7919f"  # windows inline in process_lifetimes.recent_window
MOVED = "7d3a9c41e0b8"  # windows in process_windows, records without a peak
WINDOW = bytes(range(40))


def test_windows_survive_the_move_to_their_own_table_and_back(database_url: str) -> None:
    database = create_database(database_url)
    upgrade(database, BEFORE)
    with database.begin_write() as conn:
        conn.execute(
            text(
                "INSERT INTO hosts (id, hostname, created_at, pid_namespace_isolated, fake,"
                " spool_dropped_total) VALUES (1, 'host-1', 0, false, false, 0)"
            )
        )
        conn.execute(
            text(
                "INSERT INTO gpus (id, host_id, uuid, gpu_index, lost, last_seen_at)"
                " VALUES (1, 1, 'GPU-0', 0, false, 0)"
            )
        )
        for lifetime_id, window in ((1, WINDOW), (2, None)):
            conn.execute(
                text(
                    "INSERT INTO process_lifetimes (id, host_id, gpu_id, pid, kind, orphaned,"
                    " first_seen_at, last_seen_at, recent_window)"
                    " VALUES (:id, 1, 1, :pid, 'compute', false, 0, 0, :window)"
                ),
                {"id": lifetime_id, "pid": 100 + lifetime_id, "window": window},
            )

    upgrade(database, MOVED)

    with database.engine.connect() as conn:
        assert conn.execute(
            text("SELECT lifetime_id, recent_window FROM process_windows")
        ).all() == [(1, WINDOW)]
        columns = {c["name"] for c in inspect(conn).get_columns("process_lifetimes")}
        assert "recent_window" not in columns

    with database.begin_write() as conn:
        command.downgrade(alembic_config(conn), BEFORE)

    with database.engine.connect() as conn:
        rows = conn.execute(
            text("SELECT id, recent_window FROM process_lifetimes ORDER BY id")
        ).all()
        assert [(i, None if w is None else bytes(w)) for i, w in rows] == [(1, WINDOW), (2, None)]
        assert "process_windows" not in inspect(conn).get_table_names()

    upgrade(database)
    with database.begin_write() as conn:  # a window goes with its lifetime (retention)
        conn.execute(text("DELETE FROM process_lifetimes WHERE id = 1"))
        assert conn.execute(text("SELECT count(*) FROM process_windows")).scalar() == 0
    database.dispose()


def test_old_format_windows_are_dropped_not_misread(database_url: str) -> None:
    database = create_database(database_url)
    upgrade(database, MOVED)
    with database.begin_write() as conn:
        conn.execute(
            text(
                "INSERT INTO hosts (id, hostname, created_at, pid_namespace_isolated, fake,"
                " spool_dropped_total) VALUES (1, 'host-1', 0, false, false, 0)"
            )
        )
        conn.execute(
            text(
                "INSERT INTO gpus (id, host_id, uuid, gpu_index, lost, last_seen_at)"
                " VALUES (1, 1, 'GPU-0', 0, false, 0)"
            )
        )
        conn.execute(
            text(
                "INSERT INTO process_lifetimes (id, host_id, gpu_id, pid, kind, orphaned,"
                " first_seen_at, last_seen_at) VALUES (1, 1, 1, 101, 'compute', false, 0, 0)"
            )
        )
        conn.execute(
            text("INSERT INTO process_windows (lifetime_id, recent_window) VALUES (1, :w)"),
            {"w": WINDOW},
        )

    upgrade(database)

    with database.engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM process_windows")).scalar() == 0
        assert conn.execute(text("SELECT count(*) FROM process_lifetimes")).scalar() == 1
        tables = set(inspect(conn).get_table_names())
        assert {"event_outbox", "gpu_windows"} <= tables
    database.dispose()
