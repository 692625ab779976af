"""Request dependencies: the server context, sessions, the clock, and authentication.

The context (settings, database, clock, counters) is built by :func:`create_app` and
kept on ``app.state``; nothing here is global. Routers use the ``Annotated`` aliases.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, HTTPException, Request, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session

from gpuwatch.server.auth.service import AgentIdentity, authenticate_agent
from gpuwatch.server.database.core import Database
from gpuwatch.server.metrics import ServerStats
from gpuwatch.settings import ServerSettings

log = logging.getLogger(__name__)

Clock = Callable[[], float]


@dataclass(frozen=True)
class ServerContext:
    """Everything a request handler may need, built once per app."""

    settings: ServerSettings
    database: Database
    clock: Clock
    stats: ServerStats


def get_context(request: Request) -> ServerContext:
    context: ServerContext = request.app.state.gpuwatch
    return context


Context = Annotated[ServerContext, Depends(get_context)]


def _write_session(context: Context) -> Iterator[Session]:
    # Views commit themselves, so a failed commit is answered (503), not swallowed.
    with context.database.writer() as session:
        yield session


def _read_session(context: Context) -> Iterator[Session]:
    with context.database.reader() as session:
        yield session


WriteSession = Annotated[Session, Depends(_write_session)]
ReadSession = Annotated[Session, Depends(_read_session)]

_agent_bearer = HTTPBearer(
    auto_error=False, scheme_name="agent_token", description="Per-host agent token."
)
_read_bearer = HTTPBearer(
    auto_error=False,
    scheme_name="read_token",
    description="Read token; only required when the server sets read_token.",
)


def _unauthorized(what: str) -> HTTPException:
    return HTTPException(
        status.HTTP_401_UNAUTHORIZED,
        detail=f"missing bearer {what}",
        headers={"WWW-Authenticate": "Bearer"},
    )


def require_agent(
    request: Request,
    context: Context,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_agent_bearer)],
) -> AgentIdentity:
    """The host whose token authorises this request: 401 without one, 403 if unknown.

    The token is checked in its own short read session, so a flood of bad tokens
    never takes SQLite's write lock. It is never logged.
    """
    if credentials is None:
        raise _unauthorized("agent token")
    with context.database.reader() as session:
        identity = authenticate_agent(session=session, token=credentials.credentials)
    if identity is None:
        log.warning("refused agent request from %s: unknown or revoked token", _client(request))
        raise HTTPException(status.HTTP_403_FORBIDDEN, detail="unknown or revoked token")
    return identity


def require_reader(
    request: Request,
    context: Context,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_read_bearer)],
) -> None:
    """Enforce ``read_token`` when it is set; reads are open otherwise."""
    expected = context.settings.read_token
    if expected is None:
        return
    if credentials is None:
        raise _unauthorized("read token")
    if not hmac.compare_digest(
        credentials.credentials.encode(), expected.get_secret_value().encode()
    ):
        log.warning("refused read request from %s: wrong read token", _client(request))
        raise HTTPException(status.HTTP_403_FORBIDDEN, detail="wrong read token")


Agent = Annotated[AgentIdentity, Depends(require_agent)]
Reader = Depends(require_reader)


def forbid_other_host(identity: AgentIdentity, hostname: str) -> None:
    """403 when a host's token is used to write about another host."""
    if hostname != identity.hostname:
        log.warning(
            "refused agent request: token of host %s used for host %r",
            identity.hostname,
            hostname[:256],
        )
        raise HTTPException(
            status.HTTP_403_FORBIDDEN, detail=f"this token belongs to host {identity.hostname}"
        )


def _client(request: Request) -> str:
    return request.client.host if request.client else "unknown"
