"""Agent tokens: create, list, revoke, and resolve a presented token to its host.

A token is ``gwt_`` plus 43 URL-safe characters (256 random bits). It is shown once,
by ``gpuwatch token create``; the database keeps its SHA-256 only, so a leaked
database does not let anyone push as a host. Lookup is by that digest, an indexed
equality on a value the caller cannot steer byte by byte, so it leaks no timing
about stored tokens; the final comparison is :func:`hmac.compare_digest` anyway.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass
from functools import cache
from typing import Any

from sqlalchemy import CursorResult, Select, Table, bindparam, select, update
from sqlalchemy.orm import Session

from gpuwatch.server.auth.models import AgentToken
from gpuwatch.server.hosts import service as host_service
from gpuwatch.server.hosts.models import Host

_TOKENS: Table = AgentToken.__table__  # type: ignore[assignment]
_HOSTS: Table = Host.__table__  # type: ignore[assignment]

TOKEN_PREFIX = "gwt_"
# Longest token we bother hashing; anything longer is not ours.
MAX_TOKEN_LENGTH = 128


@dataclass(frozen=True)
class AgentIdentity:
    """Who a valid token speaks for."""

    host_id: int
    hostname: str


@dataclass(frozen=True)
class TokenInfo:
    """A token as ``gpuwatch token list`` shows it: never the token itself."""

    id: int
    hostname: str
    created_at: float
    revoked_at: float | None


def hash_token(token: str) -> str:
    """Hex SHA-256 of ``token``."""
    return hashlib.sha256(token.encode()).hexdigest()


def create_token(*, session: Session, hostname: str, now: float) -> str:
    """Create a token for ``hostname`` (and the host, if new); return the token.

    The caller shows it once; only its hash is stored.
    """
    host = host_service.get_or_create_host(session=session, hostname=hostname, now=now)
    host.retired_at = None  # a retired host given a token is back (hosts/retire.py)
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    session.add(AgentToken(host_id=host.id, token_sha256=hash_token(token), created_at=now))
    session.flush()
    return token


def list_tokens(*, session: Session) -> list[TokenInfo]:
    """All tokens, oldest first, with their host and revocation time."""
    rows = session.execute(
        select(AgentToken.id, Host.hostname, AgentToken.created_at, AgentToken.revoked_at)
        .join(Host, Host.id == AgentToken.host_id)
        .order_by(AgentToken.created_at, AgentToken.id)
    )
    return [TokenInfo(*row) for row in rows]


def revoke_tokens(*, session: Session, hostname: str, now: float) -> int:
    """Revoke every unrevoked token of ``hostname``; return how many were revoked."""
    host_id = select(Host.id).where(Host.hostname == hostname).scalar_subquery()
    result: CursorResult[Any] = session.execute(  # type: ignore[assignment]
        update(AgentToken)
        .where(AgentToken.host_id == host_id, AgentToken.revoked_at.is_(None))
        .values(revoked_at=now)
    )
    return result.rowcount or 0


def token_digest(token: str) -> str | None:
    """:func:`hash_token` of a token of our shape; None for one that cannot be ours."""
    if not token.startswith(TOKEN_PREFIX) or len(token) > MAX_TOKEN_LENGTH:
        return None
    return hash_token(token)


def authenticate_agent(*, session: Session, token: str) -> AgentIdentity | None:
    """The host an unrevoked ``token`` belongs to, or None for an unknown/revoked one."""
    digest = token_digest(token)
    return None if digest is None else identity_of_digest(session=session, digest=digest)


def identity_of_digest(*, session: Session, digest: str) -> AgentIdentity | None:
    """The host whose unrevoked token hashes to ``digest``, or None."""
    # Core, on the connection: ingest runs this on every request, and the ORM's
    # execution path cost more than the indexed lookup itself.
    row = session.connection().execute(_identity_query(), {"digest": digest}).first()
    if row is None or not hmac.compare_digest(row.token_sha256, digest):
        return None
    return AgentIdentity(host_id=row.id, hostname=row.hostname)


@cache
def _identity_query() -> Select[Any]:
    # Built once: a reused statement object skips SQLAlchemy's cache-key generation.
    return (
        select(_TOKENS.c.token_sha256, _HOSTS.c.id, _HOSTS.c.hostname)
        .join(_HOSTS, _HOSTS.c.id == _TOKENS.c.host_id)
        .where(_TOKENS.c.token_sha256 == bindparam("digest"), _TOKENS.c.revoked_at.is_(None))
    )
