"""Migrations: empty -> head on both databases, with no drift from the models; and the
per-host idempotency keys, which rebuild a table on SQLite, keep every row."""

from __future__ import annotations

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect, text

from gpuwatch.server.database import create_database
from gpuwatch.server.database.core import FILLFACTOR
from gpuwatch.server.database.migrate import (
    alembic_config,
    current_revision,
    head_revision,
    upgrade,
)
from gpuwatch.server.models import metadata


def test_empty_to_head_matches_the_models(database_url: str) -> None:
    database = create_database(database_url)
    assert current_revision(database) is None

    upgrade(database)

    assert current_revision(database) == head_revision()
    with database.engine.connect() as conn:
        context = MigrationContext.configure(
            conn, opts={"compare_type": True, "render_as_batch": conn.dialect.name == "sqlite"}
        )
        assert compare_metadata(context, metadata) == []
        assert set(inspect(conn).get_table_names()) == set(metadata.tables) | {"alembic_version"}
    database.dispose()


def test_upgrade_is_idempotent(database_url: str) -> None:
    database = create_database(database_url)
    upgrade(database)
    upgrade(database)  # a second replica starting, or `gpuwatch db upgrade` after start

    assert current_revision(database) == head_revision()
    database.dispose()


BEFORE_PER_HOST_KEYS = "c42d8e1f5a67"  # snapshots_seen keyed globally, uid INTEGER


def test_per_host_keys_keep_every_row_and_cascade_nowhere(database_url: str) -> None:
    database = create_database(database_url)
    upgrade(database, BEFORE_PER_HOST_KEYS)
    with database.begin_write() as conn:
        for host_id in (1, 2):
            conn.execute(
                text(
                    "INSERT INTO hosts (id, hostname, created_at, pid_namespace_isolated, fake,"
                    " spool_dropped_total) VALUES (:id, :name, 0, false, false, 0)"
                ),
                {"id": host_id, "name": f"host-{host_id}"},
            )
        conn.execute(
            text(
                "INSERT INTO snapshots_seen (agent_id, boot_id, sequence, host_id, collected_at,"
                " received_at) VALUES ('a', 'b', 7, 1, 0, 0)"
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
                " first_seen_at, last_seen_at, uid) VALUES (1, 1, 1, 5, 'compute', false, 0, 0, 7)"
            )
        )
        conn.execute(text("INSERT INTO process_samples (lifetime_id, t) VALUES (1, 0)"))

    upgrade(database)

    with database.begin_write() as conn:
        pk = inspect(conn).get_pk_constraint("snapshots_seen")["constrained_columns"]
        assert set(pk) == {"host_id", "agent_id", "boot_id", "sequence"}
        # The same key under another host is another row now...
        conn.execute(
            text(
                "INSERT INTO snapshots_seen (agent_id, boot_id, sequence, host_id, collected_at,"
                " received_at) VALUES ('a', 'b', 7, 2, 0, 0)"
            )
        )
        # ...and the widest Linux uid fits.
        conn.execute(text("UPDATE process_lifetimes SET uid = 4294967295 WHERE id = 1"))
    with database.engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM snapshots_seen")).scalar() == 2
        assert conn.execute(text("SELECT count(*) FROM process_samples")).scalar() == 1
        assert conn.execute(text("SELECT uid FROM process_lifetimes")).scalar() == 2**32 - 1

    with database.begin_write() as conn:
        command.downgrade(alembic_config(conn), BEFORE_PER_HOST_KEYS)
    with database.engine.connect() as conn:
        # Back to one global key: the lower host keeps it.
        assert conn.execute(text("SELECT host_id FROM snapshots_seen")).scalars().all() == [1]
        assert conn.execute(text("SELECT count(*) FROM process_samples")).scalar() == 1
    database.dispose()


@pytest.mark.postgres
def test_tables_rewritten_every_push_leave_room_for_hot_updates(postgres_url: str) -> None:
    # The models and the migration agree with FILLFACTOR, and a migrated database has it.
    database = create_database(postgres_url)
    upgrade(database)
    with database.engine.connect() as conn:
        options = dict(
            conn.execute(
                text(
                    "SELECT relname, reloptions FROM pg_class WHERE relkind = 'r'"
                    " AND relnamespace = current_schema()::regnamespace"
                )
            ).all()
        )
    database.dispose()
    for table, fillfactor in FILLFACTOR.items():
        assert options[table] == [f"fillfactor={fillfactor}"], table
        assert metadata.tables[table].dialect_options["postgresql"]["with"] == {
            "fillfactor": fillfactor
        }
    # Insert-only tables keep the default.
    assert options["process_samples"] is None
