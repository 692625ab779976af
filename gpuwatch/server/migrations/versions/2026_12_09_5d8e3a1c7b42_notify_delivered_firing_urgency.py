"""Notifications (notify audit): ``alert_groups.delivered_firing``, the fingerprints a
receiver was actually told fire (a delivered notification said so, and no delivered
one has resolved them since), so a notification given up at its deadline no longer
makes the server forget that a resolution is owed; and ``notifications.urgency``
(0 critical, 1 warning, 2 info or none), so a backlog is claimed by severity, then age.

Existing groups start with ``delivered_firing`` = ``notified_firing``: what was
planned as told is the best record there is, and an extra resolution for an alert
the receiver never heard of is harmless where a missing one leaves a page open.

Revision ID: 5d8e3a1c7b42
Revises: 2f7a5c9e4d13
Create Date: 2026-12-09 09:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "5d8e3a1c7b42"
down_revision: str | Sequence[str] | None = "2f7a5c9e4d13"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column(
        "alert_groups",
        sa.Column("delivered_firing", sa.JSON(), nullable=False, server_default="[]"),
    )
    op.execute("UPDATE alert_groups SET delivered_firing = notified_firing")
    op.add_column(
        "notifications", sa.Column("urgency", sa.Integer(), nullable=False, server_default="2")
    )


def downgrade() -> None:
    with op.batch_alter_table("notifications") as batch:
        batch.drop_column("urgency")
    with op.batch_alter_table("alert_groups") as batch:
        batch.drop_column("delivered_firing")
