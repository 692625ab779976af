"""Recent windows move from process_lifetimes to a process_windows table of their own.

Ingest updates every open lifetime row on every snapshot, and both databases rewrite a
whole row to update it; a kilobyte of packed samples inline made each of those updates
several times larger than the row's own columns. Windows are copied, then the column
is dropped (``ALTER TABLE ... DROP COLUMN``: SQLite 3.35 or later, in place, so no
table rebuild and no foreign-key cascades from one).

Revision ID: 5c1e0f7a2b94
Revises: 93cfd2d7919f
Create Date: 2026-12-01 11:40:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "5c1e0f7a2b94"
down_revision: str | Sequence[str] | None = "93cfd2d7919f"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "process_windows",
        sa.Column(
            "lifetime_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False
        ),
        sa.Column("recent_window", sa.LargeBinary(), nullable=False),
        sa.ForeignKeyConstraint(
            ["lifetime_id"],
            ["process_lifetimes.id"],
            name=op.f("fk_process_windows_lifetime_id_process_lifetimes"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("lifetime_id", name=op.f("pk_process_windows")),
    )
    op.execute(
        "INSERT INTO process_windows (lifetime_id, recent_window)"
        " SELECT id, recent_window FROM process_lifetimes WHERE recent_window IS NOT NULL"
    )
    op.drop_column("process_lifetimes", "recent_window")


def downgrade() -> None:
    op.add_column("process_lifetimes", sa.Column("recent_window", sa.LargeBinary(), nullable=True))
    op.execute(
        "UPDATE process_lifetimes SET recent_window = (SELECT w.recent_window"
        " FROM process_windows AS w WHERE w.lifetime_id = process_lifetimes.id)"
    )
    op.drop_table("process_windows")
