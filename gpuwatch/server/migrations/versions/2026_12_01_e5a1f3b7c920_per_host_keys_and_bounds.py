"""Idempotency keys per host, and process uids as wide as Linux's.

* ``snapshots_seen``: the host joins the primary key, ``(host_id, agent_id, boot_id,
  sequence)``. The key's other parts are whatever a client sends, so with the old key
  one host's token could claim another host's future sequence numbers, and that host's
  real snapshots were then answered ``duplicate`` and never stored. SQLite cannot change
  a primary key in place: batch mode rebuilds the table (create, copy, drop, rename).
  No table refers to ``snapshots_seen``, so dropping the old copy cascades nowhere.
* ``process_lifetimes.uid``: BIGINT on Postgres, whose INTEGER stops at 2**31 - 1 where
  a Linux uid goes to 2**32 - 1 (one such process made every push of its host fail).
  SQLite's INTEGER already holds 64 bits; its column is left as it is, because a
  rebuild of ``process_lifetimes`` would cascade-delete its samples and windows.

Revision ID: e5a1f3b7c920
Revises: c42d8e1f5a67
Create Date: 2026-12-01 18:30:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "e5a1f3b7c920"
down_revision: str | Sequence[str] | None = "c42d8e1f5a67"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_PK = "pk_snapshots_seen"


def upgrade() -> None:
    with op.batch_alter_table("snapshots_seen") as batch:
        batch.drop_constraint(op.f(_PK), type_="primary")
        batch.create_primary_key(op.f(_PK), ["host_id", "agent_id", "boot_id", "sequence"])
    if op.get_bind().dialect.name == "postgresql":
        op.alter_column(
            "process_lifetimes",
            "uid",
            type_=sa.BigInteger(),
            existing_type=sa.Integer(),
            existing_nullable=True,
        )


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.alter_column(
            "process_lifetimes",
            "uid",
            type_=sa.Integer(),
            existing_type=sa.BigInteger(),
            existing_nullable=True,
            postgresql_using="CASE WHEN uid > 2147483647 THEN NULL ELSE uid END",
        )
    # The old key is global: of keys two hosts share, the lower host id's stays.
    op.execute(
        "DELETE FROM snapshots_seen WHERE EXISTS (SELECT 1 FROM snapshots_seen AS o"
        " WHERE o.agent_id = snapshots_seen.agent_id AND o.boot_id = snapshots_seen.boot_id"
        " AND o.sequence = snapshots_seen.sequence AND o.host_id < snapshots_seen.host_id)"
    )
    with op.batch_alter_table("snapshots_seen") as batch:
        batch.drop_constraint(op.f(_PK), type_="primary")
        batch.create_primary_key(op.f(_PK), ["agent_id", "boot_id", "sequence"])
