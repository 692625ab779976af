"""The alert engine: alerts, alert groups (the notification log), notifications, silences.

Revision ID: c42d8e1f5a67
Revises: b71e4c2d9a30
Create Date: 2026-12-01 18:20:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "c42d8e1f5a67"
down_revision: str | Sequence[str] | None = "b71e4c2d9a30"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "alert_groups",
        sa.Column("id", _ID, nullable=False),
        sa.Column("receiver", sa.String(length=64), nullable=False),
        sa.Column("group_key", sa.String(length=512), nullable=False),
        sa.Column("group_labels", sa.JSON(), nullable=False),
        sa.Column("first_alert_at", sa.Double(), nullable=True),
        sa.Column("flushed_at", sa.Double(), nullable=True),
        sa.Column("notified_at", sa.Double(), nullable=True),
        sa.Column("notified_firing", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_alert_groups")),
        sa.UniqueConstraint(
            "receiver", "group_key", name=op.f("uq_alert_groups_receiver_group_key")
        ),
    )
    op.create_table(
        "alerts",
        sa.Column("id", _ID, nullable=False),
        sa.Column("fingerprint", sa.String(length=64), nullable=False),
        sa.Column("rule", sa.String(length=64), nullable=False),
        sa.Column("labels", sa.JSON(), nullable=False),
        sa.Column("severity", sa.String(length=16), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("summary", sa.String(length=1024), nullable=False),
        sa.Column("description", sa.String(length=2048), nullable=False),
        sa.Column("culprits", sa.JSON(), nullable=False),
        sa.Column("active_since", sa.Double(), nullable=False),
        sa.Column("fired_at", sa.Double(), nullable=True),
        sa.Column("last_true_at", sa.Double(), nullable=False),
        sa.Column("resolved_at", sa.Double(), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_alerts")),
    )
    op.create_index(
        op.f("ix_alerts_state_fingerprint"), "alerts", ["state", "fingerprint"], unique=False
    )
    op.create_table(
        "notifications",
        sa.Column("id", _ID, nullable=False),
        sa.Column("receiver", sa.String(length=64), nullable=False),
        sa.Column("group_key", sa.String(length=512), nullable=False),
        sa.Column("flush_at", sa.Double(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("body", sa.JSON(), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("next_attempt_at", sa.Double(), nullable=False),
        sa.Column("deadline_at", sa.Double(), nullable=False),
        sa.Column("sent_at", sa.Double(), nullable=True),
        sa.Column("last_error", sa.String(length=512), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_notifications")),
        sa.UniqueConstraint(
            "receiver",
            "group_key",
            "flush_at",
            name=op.f("uq_notifications_receiver_group_key_flush_at"),
        ),
    )
    op.create_index(
        op.f("ix_notifications_receiver_id"), "notifications", ["receiver", "id"], unique=False
    )
    op.create_index(
        op.f("ix_notifications_status_next_attempt_at"),
        "notifications",
        ["status", "next_attempt_at"],
        unique=False,
    )
    op.create_table(
        "silences",
        sa.Column("id", _ID, nullable=False),
        sa.Column("matchers", sa.JSON(), nullable=False),
        sa.Column("starts_at", sa.Double(), nullable=False),
        sa.Column("ends_at", sa.Double(), nullable=False),
        sa.Column("created_by", sa.String(length=256), nullable=False),
        sa.Column("comment", sa.String(length=1024), nullable=False),
        sa.Column("created_at", sa.Double(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_silences")),
    )


def downgrade() -> None:
    op.drop_table("silences")
    op.drop_index(op.f("ix_notifications_status_next_attempt_at"), table_name="notifications")
    op.drop_index(op.f("ix_notifications_receiver_id"), table_name="notifications")
    op.drop_table("notifications")
    op.drop_index(op.f("ix_alerts_state_fingerprint"), table_name="alerts")
    op.drop_table("alerts")
    op.drop_table("alert_groups")
