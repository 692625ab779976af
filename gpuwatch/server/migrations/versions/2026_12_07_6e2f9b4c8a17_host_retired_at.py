"""When a host was retired (``gpuwatch token revoke HOST --retire``): a decommissioned
machine is no longer judged silent nor shown in the fleet; its history stays.

Revision ID: 6e2f9b4c8a17
Revises: 4b7e2a9c1d35
Create Date: 2026-12-07 00:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "6e2f9b4c8a17"
down_revision: str | Sequence[str] | None = "4b7e2a9c1d35"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Nullable, no default: both databases add it without rewriting the table.
    op.add_column("hosts", sa.Column("retired_at", sa.Double(), nullable=True))


def downgrade() -> None:
    op.drop_column("hosts", "retired_at")
