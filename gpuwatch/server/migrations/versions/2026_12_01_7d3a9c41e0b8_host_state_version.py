"""hosts.state_version: lets a server process reuse the host state it kept.

Revision ID: 7d3a9c41e0b8
Revises: 5c1e0f7a2b94
Create Date: 2026-12-01 12:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "7d3a9c41e0b8"
down_revision: str | Sequence[str] | None = "5c1e0f7a2b94"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # A constant default: SQLite adds the column in place, Postgres without a rewrite.
    op.add_column(
        "hosts",
        sa.Column("state_version", sa.BigInteger(), server_default="0", nullable=False),
    )


def downgrade() -> None:
    op.drop_column("hosts", "state_version")
