"""GPU health on the gpus row: uncorrected ECC errors, Xid errors, throttle reasons,
row remapping; what the alert engine's health rules read.

Revision ID: f3c8a2d6b154
Revises: e5a1f3b7c920
Create Date: 2026-12-01 19:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from alembic import op

revision: str = "f3c8a2d6b154"
down_revision: str | Sequence[str] | None = "e5a1f3b7c920"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_COLUMNS: tuple[tuple[str, sa.types.TypeEngine[Any]], ...] = (
    ("ecc_uncorrected_volatile", sa.BigInteger()),
    ("xid_errors", sa.BigInteger()),
    ("xid_last_code", sa.BigInteger()),
    ("xid_seen_at", sa.Double()),
    ("throttle_reasons", sa.String(length=256)),
    ("remap_pending", sa.Boolean()),
    ("remap_failure", sa.Boolean()),
)


def upgrade() -> None:
    for name, kind in _COLUMNS:
        op.add_column("gpus", sa.Column(name, kind, nullable=True))


def downgrade() -> None:
    for name, _ in reversed(_COLUMNS):
        op.drop_column("gpus", name)
