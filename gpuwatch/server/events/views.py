"""Events: the read API, and the agent-authenticated POST for reaped / oom events."""

from __future__ import annotations

from typing import get_args

from fastapi import APIRouter, Query

from gpuwatch.server.deps import (
    Agent,
    Context,
    Reader,
    ReadSession,
    WriteSession,
    forbid_other_host,
)
from gpuwatch.server.events import service
from gpuwatch.server.events.schemas import EventKind, EventPage, IdleHolderOut
from gpuwatch.server.pagination import MAX_LIMIT, Cursor
from gpuwatch.wire import EVENTS_PATH, ReportedEvent, ReportedEventResult

router = APIRouter(prefix=EVENTS_PATH, tags=["events"])

_KINDS = ", ".join(get_args(EventKind))


@router.get("", summary="List events", response_model=EventPage, dependencies=[Reader])
def list_events(
    session: ReadSession,
    host: str | None = Query(None, max_length=256, description="Hostname."),
    gpu: int | None = Query(None, ge=0, lt=64, description="GPU index on the host."),
    user: str | None = Query(None, max_length=256),
    kind: EventKind | None = Query(None, description=f"One of {_KINDS}."),
    since: float | None = Query(None, ge=0, description="Epoch s: still open or ended after."),
    until: float | None = Query(None, ge=0, description="Epoch s: started at or before."),
    open: bool | None = Query(
        None,
        description="true: only events whose condition still holds; false: only ended ones.",
    ),
    limit: int = Query(100, ge=1, le=MAX_LIMIT),
    cursor: str | None = Query(None, max_length=200, description="next_cursor of a page."),
) -> EventPage:
    """Events overlapping ``[since, until]``, newest first."""
    return service.list_events(
        session=session,
        hostname=host,
        gpu_index=gpu,
        user=user,
        kind=kind,
        since=since,
        until=until,
        is_open=open,
        limit=limit,
        cursor=None if cursor is None else Cursor.decode(cursor),
    )


@router.get(
    "/top-idle",
    summary="Users ranked by idle GPU memory",
    response_model=list[IdleHolderOut],
    dependencies=[Reader],
)
def top_idle(
    session: ReadSession,
    context: Context,
    since: float = Query(ge=0, description="Epoch seconds."),
    until: float | None = Query(None, ge=0, description="Epoch seconds; default now."),
    limit: int = Query(10, ge=1, le=100),
) -> list[IdleHolderOut]:
    """Held bytes x seconds flagged idle per user, largest first."""
    return service.top_idle_users(
        session=session,
        since=since,
        until=context.clock() if until is None else until,
        limit=limit,
    )


@router.post(
    "",
    summary="Report a reaped process or an OOM",
    response_model=ReportedEventResult,
    responses={
        401: {"description": "No bearer token."},
        403: {"description": "Unknown or revoked token, or a token of another host."},
        503: {"description": "Database unavailable; retry after Retry-After seconds."},
    },
)
def report_event(
    body: ReportedEvent, identity: Agent, session: WriteSession, context: Context
) -> ReportedEventResult:
    """Store an event an agent observed (stored closed). A retry stores nothing more."""
    forbid_other_host(identity, body.hostname)
    result = service.record_reported_event(
        session=session, host_id=identity.host_id, report=body, dialect=context.database.dialect
    )
    session.commit()
    if not result.duplicate:
        context.stats.count(context.stats.events_opened, body.kind)
    return result
