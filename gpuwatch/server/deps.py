"""Request dependencies: the server context, sessions, the clock, and authentication.

The context (settings, database, clock, counters, verified tokens) is built by
:func:`create_app` and kept on ``app.state``; nothing here is global. Routers use the
``Annotated`` aliases. Dependencies that touch no database are ``async``: FastAPI runs
a plain ``def`` dependency in the thread pool, a hop that costs more than the work.
"""

from __future__ import annotations

import hmac
import logging
import time
from collections.abc import Callable, Coroutine, Iterable, Iterator
from dataclasses import dataclass, field
from functools import cache
from typing import Annotated, Any

from fastapi import Depends, HTTPException, Request, Response, status
from fastapi.routing import APIRoute
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy import Select, Table, bindparam, select
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from gpuwatch.server.alerts.engine import AlertEngine
from gpuwatch.server.auth.cache import VerifiedTokens
from gpuwatch.server.auth.limits import HostRateLimiter
from gpuwatch.server.auth.models import AgentToken
from gpuwatch.server.auth.service import (
    AgentIdentity,
    authenticate_agent,
    identity_of_digest,
    token_digest,
)
from gpuwatch.server.database.core import Database
from gpuwatch.server.hosts.models import Host
from gpuwatch.server.ingest.body import BodyBudget
from gpuwatch.server.ingest.cache import HostStateCache
from gpuwatch.server.ingest.work import HostWork
from gpuwatch.server.metrics import ServerStats
from gpuwatch.settings import ServerSettings
from gpuwatch.wire import OTHER_HOST_DETAIL

log = logging.getLogger(__name__)

Clock = Callable[[], float]

# Bytes that request bodies being read and parsed may hold at once (ingest/body.py):
# 16 bodies of max_body_bytes, and never less than 128 MiB. A realistic 8 MiB batch
# is estimated at about 120 MiB of parse, so one always fits.
MIN_BODY_BUDGET_BYTES = 128 * 2**20
BODY_BUDGET_BODIES = 16


@dataclass(frozen=True)
class ServerContext:
    """Everything a request handler may need, built once per app."""

    settings: ServerSettings
    database: Database
    clock: Clock
    stats: ServerStats
    tokens: VerifiedTokens = field(default_factory=VerifiedTokens)
    host_states: HostStateCache = field(default_factory=lambda: HostStateCache(0))
    alerts: AlertEngine | None = None
    # Reported events per host (auth/limits.py); on ``clock``.
    event_limits: HostRateLimiter = field(default_factory=HostRateLimiter)
    # Monotonic seconds, for time budgets (ingest/views.py): ``clock`` may step.
    monotonic: Clock = time.monotonic
    bodies: BodyBudget = field(init=False)
    # What each host's pushes may make the ingest writer do (ingest/work.py).
    ingest_work: HostWork = field(default_factory=HostWork)

    def __post_init__(self) -> None:
        capacity = max(MIN_BODY_BUDGET_BYTES, BODY_BUDGET_BODIES * self.settings.max_body_bytes)
        object.__setattr__(self, "bodies", BodyBudget(capacity))


async def get_context(request: Request) -> ServerContext:
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


async def pushing_agent_of(request: Request, context: ServerContext) -> PushCredential:
    """:func:`require_pushing_agent` called directly, for a route that resolves its
    dependencies itself (see gpuwatch/server/ingest/views.py)."""
    return await require_pushing_agent(request, context, await _agent_bearer(request))


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
        raise _refused(_client(request))
    return identity


def _refused(client: str) -> HTTPException:
    log.warning("refused agent request from %s: unknown or revoked token", client)
    return HTTPException(status.HTTP_403_FORBIDDEN, detail="unknown or revoked token")


@dataclass(frozen=True)
class PushCredential:
    """An agent token let through to ingest, which must still :func:`confirm_push` it
    in the transaction that stores the push.

    ``cached`` is true when no read session of this request checked it: it was taken
    from the context's :class:`~gpuwatch.server.auth.cache.VerifiedTokens`.
    """

    identity: AgentIdentity
    token_sha256: str = field(repr=False)
    cached: bool
    client: str


async def require_pushing_agent(
    request: Request,
    context: Context,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_agent_bearer)],
) -> PushCredential:
    """:func:`require_agent` for ingest, the hot path: 401 without a token, 403 for an
    unknown or revoked one.

    A token this process verified before is let through without a read session (and
    without leaving the event loop); one it has not is checked in a read session in a
    worker thread, as :func:`require_agent` does, and remembered when valid. Either way
    the token only authorises the write after :func:`confirm_push` finds it, unrevoked,
    in the writing transaction itself (see gpuwatch/server/auth/cache.py).
    """
    if credentials is None:
        raise _unauthorized("agent token")
    digest = token_digest(credentials.credentials)
    if digest is None:
        raise _refused(_client(request))
    identity = context.tokens.get(digest)
    cached = identity is not None
    if identity is None:
        identity = await run_in_threadpool(verify_token_digest, context, digest)
    if identity is None:
        raise _refused(_client(request))
    return PushCredential(
        identity=identity, token_sha256=digest, cached=cached, client=_client(request)
    )


def verify_token_digest(context: ServerContext, digest: str) -> AgentIdentity | None:
    """Check a token digest in a short read session of its own (so bad tokens never
    take SQLite's write lock); remember it in ``context.tokens`` when it is valid and
    forget it when it is not. Its connection is of ingest's share, which API reads
    cannot exhaust (database/core.py, READ_CONNECTIONS)."""
    with context.database.reader(for_ingest=True) as session:
        identity = identity_of_digest(session=session, digest=digest)
    if identity is None:
        context.tokens.discard(digest)
    else:
        context.tokens.add(digest, identity)
    return identity


def reverify_push(context: ServerContext, credential: PushCredential) -> None:
    """For a push about to be refused for its body: 403 instead when the token came
    from the cache and is no longer valid, exactly as an uncached one would have been
    answered (a 422 makes the agent drop the snapshot, a 403 keeps it spooled)."""
    if credential.cached and verify_token_digest(context, credential.token_sha256) is None:
        raise _refused(credential.client)


def confirm_push(session: Session, context: ServerContext, credential: PushCredential) -> None:
    """403, and the token forgotten, unless it is still unrevoked, still names the same
    host and that host is not retired, read in ``session``: the transaction that stores
    the push. This is what makes revocation immediate on every replica, cache or not.

    On Postgres the read also locks the token's row ``FOR SHARE`` until the push
    commits (the same query, no extra round trip; the lock costs Postgres a tuple lock,
    a small WAL record, per push). Without it the read, under READ COMMITTED, saw the
    token as it was before a ``token revoke`` (or ``--retire``, hosts/retire.py) in
    flight committed, and the push, queued behind the retire's lock on the host row,
    was stored after it: events and lifetimes reopened on a retired host. With it, a
    push either commits before the revoking transaction can revoke its token, or
    waits for that transaction and then finds the token revoked (Postgres rechecks
    the row it waited for). Every writer takes token locks before host locks (the
    revoke and retire do, :func:`lock_push_tokens` does for a batch of several hosts),
    so the two cannot deadlock. SQLite needs none of it: ``BEGIN IMMEDIATE`` already
    serialises writers.
    """
    row = session.connection().execute(_confirm_query(), {"digest": credential.token_sha256})
    found = row.first()
    if (
        found is None
        or not hmac.compare_digest(found.token_sha256, credential.token_sha256)
        or AgentIdentity(host_id=found.id, hostname=found.hostname) != credential.identity
    ):
        context.tokens.discard(credential.token_sha256)
        raise _refused(credential.client)


def lock_push_tokens(session: Session, credentials: Iterable[PushCredential]) -> None:
    """Lock the token rows of ``credentials`` (Postgres: ``FOR SHARE``) in id order, in
    one statement: a transaction storing pushes of several hosts calls this before it
    locks their host rows, so it takes token locks before host locks as
    :func:`confirm_push` of a single push and a retire do. Revoked or unknown tokens are
    left to :func:`confirm_push` to refuse."""
    digests = sorted({credential.token_sha256 for credential in credentials})
    session.connection().execute(_lock_tokens_query(), {"digests": digests}).all()


_TOKENS: Table = AgentToken.__table__  # type: ignore[assignment]
_HOSTS: Table = Host.__table__  # type: ignore[assignment]


@cache
def _confirm_query() -> Select[Any]:
    # Built once: a reused statement object skips SQLAlchemy's cache-key generation.
    return (
        select(_TOKENS.c.token_sha256, _HOSTS.c.id, _HOSTS.c.hostname)
        .join(_HOSTS, _HOSTS.c.id == _TOKENS.c.host_id)
        .where(
            _TOKENS.c.token_sha256 == bindparam("digest"),
            _TOKENS.c.revoked_at.is_(None),
            _HOSTS.c.retired_at.is_(None),
        )
        .with_for_update(read=True, of=_TOKENS)
    )


@cache
def _lock_tokens_query() -> Select[Any]:
    return (
        select(_TOKENS.c.id)
        .where(_TOKENS.c.token_sha256.in_(bindparam("digests", expanding=True)))
        .order_by(_TOKENS.c.id)
        .with_for_update(read=True)
    )


def require_reader(
    request: Request,
    context: Context,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_read_bearer)],
) -> None:
    """Enforce ``read_token`` when it is set (the admin token reads too); reads are open
    otherwise."""
    expected = context.settings.read_token
    if expected is None:
        return
    if credentials is None:
        raise _unauthorized("read token")
    given = credentials.credentials.encode()
    admin = context.settings.admin_token
    # Both compared, always: which one matched must not show in the timing.
    read_ok = hmac.compare_digest(given, expected.get_secret_value().encode())
    admin_ok = admin is not None and hmac.compare_digest(given, admin.get_secret_value().encode())
    if not (read_ok or admin_ok):
        log.warning("refused read request from %s: wrong read token", _client(request))
        raise HTTPException(status.HTTP_403_FORBIDDEN, detail="wrong read token")


def require_admin(
    request: Request,
    context: Context,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_read_bearer)],
) -> None:
    """Changes through the API (silences, receiver tests) need ``admin_token`` when it
    is set; without one they need what reads need."""
    expected = context.settings.admin_token
    if expected is None:
        require_reader(request, context, credentials)
        return
    if credentials is None:
        raise _unauthorized("admin token")
    if not hmac.compare_digest(
        credentials.credentials.encode(), expected.get_secret_value().encode()
    ):
        log.warning("refused change request from %s: wrong admin token", _client(request))
        raise HTTPException(status.HTTP_403_FORBIDDEN, detail="wrong admin token")


class AdminFirstRoute(APIRoute):
    """An :class:`APIRoute` for a change with a body: the admin token is checked from the
    headers before FastAPI reads the body.

    FastAPI reads and parses a route's body before it solves its dependencies, so
    ``dependencies=[Admin]`` alone let anyone without a token make the server read and
    parse up to ``max_body_bytes`` (8 MiB) of JSON per request: memory before
    authentication, the class the ingest routes had been fixed for. The route keeps
    ``Admin`` among its dependencies, for the OpenAPI document."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def handle(request: Request) -> Response:
            context = await get_context(request)
            require_admin(request, context, await _read_bearer(request))
            return await handler(request)

        return handle


Agent = Annotated[AgentIdentity, Depends(require_agent)]
PushingAgent = Annotated[PushCredential, Depends(require_pushing_agent)]
Reader = Depends(require_reader)
Admin = Depends(require_admin)


def forbid_other_host(identity: AgentIdentity, hostname: str) -> None:
    """403 when a host's token is used to write about another host."""
    if hostname != identity.hostname:
        log.warning(
            "refused agent request: token of host %s used for host %r",
            identity.hostname,
            hostname[:256],
        )
        raise HTTPException(status.HTTP_403_FORBIDDEN, detail=OTHER_HOST_DETAIL + identity.hostname)


def _client(request: Request) -> str:
    return request.client.host if request.client else "unknown"
