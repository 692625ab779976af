"""Events: the read API, and the agent-authenticated POST for reaped / oom events.

The POST resolves its arguments itself (:class:`ReportRoute`), in the order that keeps
a hostile client cheap: the token from the headers (401/403), the host's rate limits
(429 when both its buckets are empty), then at most ``MAX_EVENT_BODY`` bytes of body
within the server's parse budget (413/503, ingest/body.py), then validation (422), the
bucket of the event's kind (429), and only then a write transaction, which confirms
the token again. FastAPI's own handler would read and parse the body before any of that.

Each host has two buckets (auth/limits.py): one for the reaper's ``reaped`` events
(warnings, withdrawals, stops) and one for everything else. Any local user can make the
host's agent forward OOM incidents, and those must never use up the budget of the
warning an owner is owed before their process is stopped.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Coroutine
from typing import Any, get_args

from fastapi import APIRouter, HTTPException, Query, Request, Response, status
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool

from gpuwatch.server.auth.limits import HostRateLimiter, event_cost, retry_after_header
from gpuwatch.server.database.core import describe
from gpuwatch.server.deps import (
    Agent,
    Context,
    PushCredential,
    Reader,
    ReadSession,
    ServerContext,
    WriteSession,
    confirm_push,
    forbid_other_host,
    get_context,
    pushing_agent_of,
)
from gpuwatch.server.events import service
from gpuwatch.server.events.schemas import EventKind, EventPage, IdleHolderOut
from gpuwatch.server.ingest.body import (
    FREE_JSON_BYTE_FACTOR,
    STORE_ERRORS,
    Deadline,
    never_storable,
    parse_estimate,
    read_body,
    refusal,
    require_json,
)
from gpuwatch.server.ingest.service import MAX_FUTURE_SKEW_SECONDS
from gpuwatch.server.pagination import MAX_LIMIT, Cursor, refuse_reversed_range
from gpuwatch.snapshot import NO_NUL
from gpuwatch.wire import EVENTS_PATH, MAX_EVENT_BODY, ReportedEvent, ReportedEventResult

log = logging.getLogger(__name__)

router = APIRouter(prefix=EVENTS_PATH, tags=["events"])

_KINDS = ", ".join(get_args(EventKind))


@router.get("", summary="List events", response_model=EventPage, dependencies=[Reader])
def list_events(
    session: ReadSession,
    host: str | None = Query(None, max_length=256, pattern=NO_NUL, description="Hostname."),
    gpu: int | None = Query(None, ge=0, lt=64, description="GPU index on the host."),
    user: str | None = Query(None, max_length=256, pattern=NO_NUL),
    kind: EventKind | None = Query(None, description=f"One of {_KINDS}."),
    since: float | None = Query(
        None, ge=0, allow_inf_nan=False, description="Epoch s: still open or ended after."
    ),
    until: float | None = Query(
        None, ge=0, allow_inf_nan=False, description="Epoch s: started at or before."
    ),
    open: bool | None = Query(
        None,
        description="true: only events whose condition still holds; false: only ended ones.",
    ),
    limit: int = Query(100, ge=1, le=MAX_LIMIT),
    cursor: str | None = Query(
        None, max_length=200, pattern=NO_NUL, description="next_cursor of a page."
    ),
) -> EventPage:
    """Events overlapping ``[since, until]``, newest first; ``until`` before ``since``
    is a 422."""
    refuse_reversed_range(since, until)
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
        cursor=None if cursor is None else Cursor.decode(cursor, of=service.EVENTS),
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
    since: float = Query(ge=0, allow_inf_nan=False, description="Epoch seconds."),
    until: float | None = Query(
        None, ge=0, allow_inf_nan=False, description="Epoch seconds; default now."
    ),
    limit: int = Query(10, ge=1, le=100),
) -> list[IdleHolderOut]:
    """Held bytes x seconds flagged idle per user, largest first (ties by user); users
    with none in the range are not listed. ``until`` (default now) before ``since`` is
    a 422."""
    end = context.clock() if until is None else until
    refuse_reversed_range(since, end)
    return service.top_idle_users(session=session, since=since, until=end, limit=limit)


def report_event(
    body: ReportedEvent, identity: Agent, session: WriteSession, context: Context
) -> ReportedEventResult:
    """Store an event an agent observed (stored closed). A retry stores nothing more.

    At most MAX_EVENT_BODY bytes (evidence at most MAX_EVIDENCE_BYTES); each host may
    report a burst of events, then about one every 5 s (more for large ones): 429 with
    Retry-After past that. ``reaped`` events have a budget of their own, so OOM
    incidents cannot use up the reaper's.
    """
    forbid_other_host(identity, body.hostname)
    result = service.record_reported_event(
        session=session, host_id=identity.host_id, report=body, dialect=context.database.dialect
    )
    session.commit()
    if not result.duplicate:
        context.stats.count(context.stats.events_opened, body.kind)
    return result


class ReportRoute(APIRoute):
    """An :class:`APIRoute` that authenticates, rate-limits and bounds the body before
    reading it, then calls :func:`report_event` with what it resolved. The endpoint's
    signature still declares its body and dependencies, for the OpenAPI document."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        async def handle(request: Request) -> Response:
            context = await get_context(request)
            credential = await pushing_agent_of(request, context)
            host_id = credential.identity.host_id
            buckets = (context.event_limits, reaper_limits(request))
            _limit(buckets, context, host_id, cost=1.0, taking=False)  # before reading
            require_json(request)
            deadline = Deadline.after(
                context.settings.ingest_time_budget_seconds, clock=context.monotonic
            )
            with context.bodies.reserve(host_id) as reservation:
                raw = await read_body(
                    request, limit=MAX_EVENT_BODY, reservation=reservation, deadline=deadline
                )
                reservation.grow_to(parse_estimate(raw, byte_factor=FREE_JSON_BYTE_FACTOR))
                body = await run_in_threadpool(_parse, raw)
                bucket = buckets[1] if body.kind == "reaped" else buckets[0]
                _limit((bucket,), context, host_id, cost=event_cost(len(raw)), taking=True)
                result = await run_in_threadpool(_record, body, credential, context)
            return Response(result.model_dump_json(), media_type="application/json")

        return handle


def reaper_limits(request: Request) -> HostRateLimiter:
    """The app's per-host bucket for ``reaped`` events, made on first use (kept on the
    app's state beside its :class:`ServerContext`, which holds the other bucket)."""
    state = request.app.state
    limits: HostRateLimiter | None = getattr(state, "gpuwatch_reaper_event_limits", None)
    if limits is None:
        limits = state.gpuwatch_reaper_event_limits = HostRateLimiter()
    return limits


def _limit(
    buckets: tuple[HostRateLimiter, ...],
    context: ServerContext,
    host_id: int,
    *,
    cost: float,
    taking: bool,
) -> None:
    """429 with Retry-After unless one of the host's ``buckets`` holds ``cost`` units
    (taken from it if ``taking``)."""
    now = context.clock()
    waits = []
    for limits in buckets:
        ask = limits.take if taking else limits.wait
        wait = ask(host_id, now=now, cost=cost)
        if wait is None:
            return
        waits.append(wait)
    raise HTTPException(
        status.HTTP_429_TOO_MANY_REQUESTS,
        detail="this host reports events faster than the server accepts them",
        headers=retry_after_header(min(waits)),
    )


def _parse(raw: bytearray) -> ReportedEvent:
    try:
        return ReportedEvent.model_validate_json(raw)
    except ValidationError as err:
        errors = err.errors(include_url=False, include_input=False)
        for error in errors:
            error["loc"] = ("body", *error["loc"])
        raise RequestValidationError(errors) from err


def _record(
    body: ReportedEvent, credential: PushCredential, context: ServerContext
) -> ReportedEventResult:
    _check_time(body.occurred_at, context)
    with context.database.writer() as session:
        confirm_push(session, context, credential)
        try:
            return report_event(body, credential.identity, session, context)
        except STORE_ERRORS as err:
            if not never_storable(err):
                raise
            log.error(
                "host %s: quarantined a reported %s event the database refused: %s",
                credential.identity.hostname,
                body.kind,
                describe(err),
                exc_info=err,
            )
            raise refusal(
                "quarantined", ("body",), f"the database cannot store this event: {describe(err)}"
            ) from err


def _check_time(occurred_at: float, context: ServerContext) -> None:
    """422 ``clock_skew`` for a time no honest agent reports now.

    Ahead, the snapshots' rule: an event dated far ahead would stay "recent" (a firing
    process_reaped alert that never ages out) and head every newest-first list. Behind,
    the retention window: retention deletes anything older at its next run, so such an
    event is a wrong clock or a made-up time (an OOM's time is its sender's word, and
    any local user can send one), and it would stretch the events chart over decades.
    """
    now = context.clock()
    if occurred_at > now + MAX_FUTURE_SKEW_SECONDS:
        raise refusal(
            "clock_skew",
            ("body", "occurred_at"),
            f"the event occurred more than {MAX_FUTURE_SKEW_SECONDS:.0f} s in the future;"
            " fix the agent's clock",
        )
    retention_days = context.settings.retention_days
    if occurred_at < now - retention_days * 86400:
        raise refusal(
            "clock_skew",
            ("body", "occurred_at"),
            f"the event occurred more than {retention_days:g} days ago (retention_days),"
            " earlier than the server keeps anything; fix the sender's clock",
        )


router.add_api_route(
    "",
    report_event,
    methods=["POST"],
    summary="Report a reaped process or an OOM",
    response_model=ReportedEventResult,
    responses={
        401: {"description": "No bearer token."},
        403: {"description": "Unknown or revoked token, or a token of another host."},
        413: {"description": "Body larger than MAX_EVENT_BODY (1 MiB), or too costly to parse."},
        415: {"description": "Content-Type is not application/json."},
        422: {
            "description": "Not a valid event, one dated more than 10 min ahead of the"
            " server's clock or further back than retention_days (clock_skew), or one the"
            " database cannot store."
        },
        429: {
            "description": "This host's event rate limit, or two of its requests already"
            " being read; retry after Retry-After seconds."
        },
        503: {
            "description": "Database unavailable, the server is parsing as much as it may"
            " at once, or the body did not arrive within the time budget; retry after"
            " Retry-After seconds."
        },
    },
    route_class_override=ReportRoute,
)
