"""Idempotency records: every snapshot key the server has accepted, within retention."""

from __future__ import annotations

from sqlalchemy import BigInteger, Double, ForeignKey, String
from sqlalchemy.orm import Mapped, mapped_column

from gpuwatch.server.database.core import Base


class SnapshotSeen(Base):
    """``(agent_id, boot_id, sequence)`` of one accepted snapshot.

    The primary key is the idempotency key: a retried push inserts nothing
    (``INSERT ... ON CONFLICT DO NOTHING``) and is answered "duplicate".
    """

    __tablename__ = "snapshots_seen"

    agent_id: Mapped[str] = mapped_column(String(256), primary_key=True)
    boot_id: Mapped[str] = mapped_column(String(256), primary_key=True)
    sequence: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    host_id: Mapped[int] = mapped_column(ForeignKey("hosts.id", ondelete="CASCADE"))
    collected_at: Mapped[float] = mapped_column(Double)
    received_at: Mapped[float] = mapped_column(Double, index=True)
