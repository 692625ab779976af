"""Idempotency records: every snapshot key the server has accepted, within retention."""

from __future__ import annotations

from sqlalchemy import BigInteger, Double, ForeignKey, PrimaryKeyConstraint, String
from sqlalchemy.orm import Mapped, mapped_column

from gpuwatch.server.database.core import Base


class SnapshotSeen(Base):
    """``(agent_id, boot_id, sequence)`` of one accepted snapshot, per host.

    The primary key is the idempotency key within the host whose token pushed it: a
    retried push inserts nothing (``INSERT ... ON CONFLICT DO NOTHING``) and is answered
    "duplicate". The host comes first because the key's other parts are whatever the
    client sends: another host's token naming this host's agent and boot ids must not
    claim this host's sequence numbers.
    """

    __tablename__ = "snapshots_seen"
    __table_args__ = (PrimaryKeyConstraint("host_id", "agent_id", "boot_id", "sequence"),)

    agent_id: Mapped[str] = mapped_column(String(256))
    boot_id: Mapped[str] = mapped_column(String(256))
    sequence: Mapped[int] = mapped_column(BigInteger)
    host_id: Mapped[int] = mapped_column(ForeignKey("hosts.id", ondelete="CASCADE"))
    collected_at: Mapped[float] = mapped_column(Double)
    received_at: Mapped[float] = mapped_column(Double, index=True)
