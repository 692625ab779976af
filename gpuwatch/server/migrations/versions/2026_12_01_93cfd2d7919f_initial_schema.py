"""Initial schema: hosts, GPUs, tokens, idempotency keys, lifetimes, samples, events.

Revision ID: 93cfd2d7919f
Revises:
Create Date: 2026-12-01 09:07:48.628280
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "93cfd2d7919f"
down_revision: str | Sequence[str] | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "hosts",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("hostname", sa.String(length=256), nullable=False),
        sa.Column("created_at", sa.Double(), nullable=False),
        sa.Column("agent_id", sa.String(length=256), nullable=True),
        sa.Column("boot_id", sa.String(length=256), nullable=True),
        sa.Column("last_sequence", sa.BigInteger(), nullable=True),
        sa.Column("last_seen_at", sa.Double(), nullable=True),
        sa.Column("last_received_at", sa.Double(), nullable=True),
        sa.Column("driver_version", sa.String(length=256), nullable=True),
        sa.Column("cuda_driver_version", sa.String(length=256), nullable=True),
        sa.Column("pid_namespace_isolated", sa.Boolean(), nullable=False),
        sa.Column("fake", sa.Boolean(), nullable=False),
        sa.Column("spool_dropped_total", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_hosts")),
        sa.UniqueConstraint("hostname", name=op.f("uq_hosts_hostname")),
    )
    op.create_table(
        "agent_tokens",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("host_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("token_sha256", sa.String(length=64), nullable=False),
        sa.Column("created_at", sa.Double(), nullable=False),
        sa.Column("revoked_at", sa.Double(), nullable=True),
        sa.ForeignKeyConstraint(
            ["host_id"],
            ["hosts.id"],
            name=op.f("fk_agent_tokens_host_id_hosts"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_agent_tokens")),
        sa.UniqueConstraint("token_sha256", name=op.f("uq_agent_tokens_token_sha256")),
    )
    op.create_index(op.f("ix_agent_tokens_host_id"), "agent_tokens", ["host_id"], unique=False)
    op.create_table(
        "gpus",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("host_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("uuid", sa.String(length=256), nullable=False),
        sa.Column("gpu_index", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=256), nullable=True),
        sa.Column("memory_total_bytes", sa.BigInteger(), nullable=True),
        sa.Column("memory_used_bytes", sa.BigInteger(), nullable=True),
        sa.Column("memory_free_bytes", sa.BigInteger(), nullable=True),
        sa.Column("unattributed_bytes", sa.BigInteger(), nullable=True),
        sa.Column("utilization_ratio", sa.Double(), nullable=True),
        sa.Column("lost", sa.Boolean(), nullable=False),
        sa.Column("read_error", sa.String(length=256), nullable=True),
        sa.Column("last_seen_at", sa.Double(), nullable=False),
        sa.Column("bucket_start_at", sa.Double(), nullable=True),
        sa.Column("bucket_used_bytes", sa.BigInteger(), nullable=True),
        sa.Column("bucket_unattributed_bytes", sa.BigInteger(), nullable=True),
        sa.ForeignKeyConstraint(
            ["host_id"], ["hosts.id"], name=op.f("fk_gpus_host_id_hosts"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_gpus")),
        sa.UniqueConstraint("host_id", "uuid", name=op.f("uq_gpus_host_id_uuid")),
    )
    op.create_table(
        "snapshots_seen",
        sa.Column("agent_id", sa.String(length=256), nullable=False),
        sa.Column("boot_id", sa.String(length=256), nullable=False),
        sa.Column("sequence", sa.BigInteger(), nullable=False),
        sa.Column("host_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("collected_at", sa.Double(), nullable=False),
        sa.Column("received_at", sa.Double(), nullable=False),
        sa.ForeignKeyConstraint(
            ["host_id"],
            ["hosts.id"],
            name=op.f("fk_snapshots_seen_host_id_hosts"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("agent_id", "boot_id", "sequence", name=op.f("pk_snapshots_seen")),
    )
    op.create_index(
        op.f("ix_snapshots_seen_received_at"), "snapshots_seen", ["received_at"], unique=False
    )
    op.create_table(
        "gpu_samples",
        sa.Column("gpu_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("t", sa.Double(), nullable=False),
        sa.Column("used_bytes", sa.BigInteger(), nullable=True),
        sa.Column("total_bytes", sa.BigInteger(), nullable=True),
        sa.Column("unattributed_bytes", sa.BigInteger(), nullable=True),
        sa.ForeignKeyConstraint(
            ["gpu_id"], ["gpus.id"], name=op.f("fk_gpu_samples_gpu_id_gpus"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("gpu_id", "t", name=op.f("pk_gpu_samples")),
    )
    op.create_index(op.f("ix_gpu_samples_t"), "gpu_samples", ["t"], unique=False)
    op.create_table(
        "process_lifetimes",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("host_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("gpu_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=False),
        sa.Column("start_time", sa.Double(), nullable=True),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("name", sa.String(length=256), nullable=True),
        sa.Column("command", sa.String(length=4096), nullable=True),
        sa.Column("user", sa.String(length=256), nullable=True),
        sa.Column("uid", sa.Integer(), nullable=True),
        sa.Column("container_id", sa.String(length=256), nullable=True),
        sa.Column("pod_uid", sa.String(length=256), nullable=True),
        sa.Column("slurm_job_id", sa.String(length=256), nullable=True),
        sa.Column("orphaned", sa.Boolean(), nullable=False),
        sa.Column("first_seen_at", sa.Double(), nullable=False),
        sa.Column("last_seen_at", sa.Double(), nullable=False),
        sa.Column("ended_at", sa.Double(), nullable=True),
        sa.Column("current_bytes", sa.BigInteger(), nullable=True),
        sa.Column("peak_bytes", sa.BigInteger(), nullable=True),
        sa.Column("sm_ratio", sa.Double(), nullable=True),
        sa.Column("idle_since", sa.Double(), nullable=True),
        sa.Column("bucket_start_at", sa.Double(), nullable=True),
        sa.Column("bucket_min_bytes", sa.BigInteger(), nullable=True),
        sa.Column("bucket_max_bytes", sa.BigInteger(), nullable=True),
        sa.Column("bucket_max_sm_ratio", sa.Double(), nullable=True),
        sa.Column("recent_window", sa.LargeBinary(), nullable=True),
        sa.ForeignKeyConstraint(
            ["gpu_id"],
            ["gpus.id"],
            name=op.f("fk_process_lifetimes_gpu_id_gpus"),
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["host_id"],
            ["hosts.id"],
            name=op.f("fk_process_lifetimes_host_id_hosts"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_process_lifetimes")),
        sa.UniqueConstraint(
            "host_id",
            "gpu_id",
            "pid",
            "start_time",
            name=op.f("uq_process_lifetimes_host_id_gpu_id_pid_start_time"),
        ),
    )
    op.create_index(
        op.f("ix_process_lifetimes_gpu_id_first_seen_at"),
        "process_lifetimes",
        ["gpu_id", "first_seen_at"],
        unique=False,
    )
    op.create_index(
        op.f("ix_process_lifetimes_host_id_ended_at"),
        "process_lifetimes",
        ["host_id", "ended_at"],
        unique=False,
    )
    op.create_index(
        op.f("ix_process_lifetimes_user_first_seen_at"),
        "process_lifetimes",
        ["user", "first_seen_at"],
        unique=False,
    )
    op.create_table(
        "events",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("reason", sa.String(length=64), nullable=False),
        sa.Column("host_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("dedup_key", sa.String(length=128), nullable=False),
        sa.Column("gpu_uuid", sa.String(length=256), nullable=True),
        sa.Column("gpu_index", sa.Integer(), nullable=True),
        sa.Column(
            "lifetime_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=True
        ),
        sa.Column("pid", sa.Integer(), nullable=True),
        sa.Column("user", sa.String(length=256), nullable=True),
        sa.Column("held_bytes", sa.BigInteger(), nullable=True),
        sa.Column("summary", sa.String(length=1024), nullable=False),
        sa.Column("evidence", sa.JSON(), nullable=False),
        sa.Column("started_at", sa.Double(), nullable=False),
        sa.Column("last_seen_at", sa.Double(), nullable=False),
        sa.Column("ended_at", sa.Double(), nullable=True),
        sa.ForeignKeyConstraint(
            ["host_id"], ["hosts.id"], name=op.f("fk_events_host_id_hosts"), ondelete="CASCADE"
        ),
        sa.ForeignKeyConstraint(
            ["lifetime_id"],
            ["process_lifetimes.id"],
            name=op.f("fk_events_lifetime_id_process_lifetimes"),
            ondelete="SET NULL",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_events")),
        sa.UniqueConstraint(
            "host_id",
            "dedup_key",
            "started_at",
            name=op.f("uq_events_host_id_dedup_key_started_at"),
        ),
    )
    op.create_index(
        op.f("ix_events_host_id_ended_at"), "events", ["host_id", "ended_at"], unique=False
    )
    op.create_index(
        op.f("ix_events_kind_started_at"), "events", ["kind", "started_at"], unique=False
    )
    op.create_index(op.f("ix_events_lifetime_id"), "events", ["lifetime_id"], unique=False)
    op.create_index(op.f("ix_events_started_at_id"), "events", ["started_at", "id"], unique=False)
    op.create_table(
        "process_samples",
        sa.Column(
            "lifetime_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False
        ),
        sa.Column("t", sa.Double(), nullable=False),
        sa.Column("used_bytes", sa.BigInteger(), nullable=True),
        sa.Column("peak_bytes", sa.BigInteger(), nullable=True),
        sa.Column("sm_ratio", sa.Double(), nullable=True),
        sa.ForeignKeyConstraint(
            ["lifetime_id"],
            ["process_lifetimes.id"],
            name=op.f("fk_process_samples_lifetime_id_process_lifetimes"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("lifetime_id", "t", name=op.f("pk_process_samples")),
    )
    op.create_index(op.f("ix_process_samples_t"), "process_samples", ["t"], unique=False)


def downgrade() -> None:
    op.drop_index(op.f("ix_process_samples_t"), table_name="process_samples")
    op.drop_table("process_samples")
    op.drop_index(op.f("ix_events_started_at_id"), table_name="events")
    op.drop_index(op.f("ix_events_lifetime_id"), table_name="events")
    op.drop_index(op.f("ix_events_kind_started_at"), table_name="events")
    op.drop_index(op.f("ix_events_host_id_ended_at"), table_name="events")
    op.drop_table("events")
    op.drop_index(op.f("ix_process_lifetimes_user_first_seen_at"), table_name="process_lifetimes")
    op.drop_index(op.f("ix_process_lifetimes_host_id_ended_at"), table_name="process_lifetimes")
    op.drop_index(op.f("ix_process_lifetimes_gpu_id_first_seen_at"), table_name="process_lifetimes")
    op.drop_table("process_lifetimes")
    op.drop_index(op.f("ix_gpu_samples_t"), table_name="gpu_samples")
    op.drop_table("gpu_samples")
    op.drop_index(op.f("ix_snapshots_seen_received_at"), table_name="snapshots_seen")
    op.drop_table("snapshots_seen")
    op.drop_table("gpus")
    op.drop_index(op.f("ix_agent_tokens_host_id"), table_name="agent_tokens")
    op.drop_table("agent_tokens")
    op.drop_table("hosts")
