"""The push interval each host's agent reports (``Gpuwatch-Push-Interval``): a host's
silence is counted in its own intervals, so agents pushing every minute beside others
pushing every 15 s are neither judged silent between pushes nor left unjudged.

Revision ID: 9c4d1e7b2f60
Revises: 6e2f9b4c8a17
Create Date: 2026-12-07 09:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "9c4d1e7b2f60"
down_revision: str | Sequence[str] | None = "6e2f9b4c8a17"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Nullable, no default: both databases add it without rewriting the table. NULL is
    # an agent that does not report its interval (the server's setting applies).
    op.add_column("hosts", sa.Column("push_interval_seconds", sa.Double(), nullable=True))


def downgrade() -> None:
    op.drop_column("hosts", "push_interval_seconds")
