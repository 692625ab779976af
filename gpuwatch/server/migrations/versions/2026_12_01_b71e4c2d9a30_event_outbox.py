"""Detection you can act on: the event outbox, GPU windows, and a new window format.

* ``event_outbox``: one row per change of an event, written in the event's own
  transaction (server/events/outbox.py), for the alert engine to consume.
* ``gpu_windows`` and ``gpus.bucket_low_bytes``: the GPU's recent memory envelope,
  read by the filling-up detector.
* ``gpus.unattributed_since``: unattributed memory must show in two consecutive
  snapshots before its event opens.
* ``process_windows`` records gained the bucket's peak (``<dqqf``, was ``<dqf``), so
  the old blobs cannot be read: they are dropped and refill as buckets close (trend
  verdicts wait one detection window after the upgrade; open events stay open and are
  re-evaluated then).

Revision ID: b71e4c2d9a30
Revises: 7d3a9c41e0b8
Create Date: 2026-12-01 18:05:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "b71e4c2d9a30"
down_revision: str | Sequence[str] | None = "7d3a9c41e0b8"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "event_outbox",
        sa.Column("id", _ID, nullable=False),
        sa.Column("event_id", _ID, nullable=False),
        sa.Column("host_id", _ID, nullable=False),
        sa.Column("change", sa.String(length=16), nullable=False),
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("reason", sa.String(length=64), nullable=False),
        sa.Column("at", sa.Double(), nullable=False),
        sa.Column("processed_at", sa.Double(), nullable=True),
        sa.ForeignKeyConstraint(
            ["event_id"],
            ["events.id"],
            name=op.f("fk_event_outbox_event_id_events"),
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["host_id"],
            ["hosts.id"],
            name=op.f("fk_event_outbox_host_id_hosts"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_event_outbox")),
    )
    op.create_index(op.f("ix_event_outbox_event_id"), "event_outbox", ["event_id"], unique=False)
    op.create_index(
        op.f("ix_event_outbox_processed_at_id"),
        "event_outbox",
        ["processed_at", "id"],
        unique=False,
    )
    op.create_table(
        "gpu_windows",
        sa.Column("gpu_id", _ID, nullable=False),
        sa.Column("recent_window", sa.LargeBinary(), nullable=False),
        sa.ForeignKeyConstraint(
            ["gpu_id"], ["gpus.id"], name=op.f("fk_gpu_windows_gpu_id_gpus"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("gpu_id", name=op.f("pk_gpu_windows")),
    )
    op.add_column("gpus", sa.Column("bucket_low_bytes", sa.BigInteger(), nullable=True))
    op.add_column("gpus", sa.Column("unattributed_since", sa.Double(), nullable=True))
    op.execute("DELETE FROM process_windows")
    op.execute(
        "UPDATE events SET ended_at = last_seen_at WHERE ended_at IS NULL"
        " AND (dedup_key LIKE 'share:%' OR dedup_key LIKE 'leak:%')"
    )


def downgrade() -> None:
    op.execute("DELETE FROM process_windows")
    op.drop_column("gpus", "unattributed_since")
    op.drop_column("gpus", "bucket_low_bytes")
    op.drop_table("gpu_windows")
    op.drop_index(op.f("ix_event_outbox_processed_at_id"), table_name="event_outbox")
    op.drop_index(op.f("ix_event_outbox_event_id"), table_name="event_outbox")
    op.drop_table("event_outbox")
