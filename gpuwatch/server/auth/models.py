"""Per-host agent tokens. Only the SHA-256 of a token is stored, never the token."""

from __future__ import annotations

from sqlalchemy import Double, ForeignKey, String
from sqlalchemy.orm import Mapped, mapped_column

from gpuwatch.server.database.core import Base, IdType


class AgentToken(Base):
    """A bearer token bound to one host: it can write that host's snapshots only.

    Several unrevoked tokens per host may coexist, so a token can be rotated without
    a gap: create the new one, deploy it, revoke the old one.
    """

    __tablename__ = "agent_tokens"

    id: Mapped[int] = mapped_column(IdType, primary_key=True)
    host_id: Mapped[int] = mapped_column(ForeignKey("hosts.id", ondelete="CASCADE"), index=True)
    # Hex SHA-256 of the token. Tokens carry 256 random bits, so a plain (unsalted,
    # fast) hash is enough: there is no dictionary to attack, unlike passwords.
    token_sha256: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[float] = mapped_column(Double)
    revoked_at: Mapped[float | None] = mapped_column(Double)
