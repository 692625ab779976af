"""``POST /api/v1/snapshots``: HTTP in, :func:`ingest_snapshots` out.

The body is read raw and validated with ``IngestRequest.model_validate_json``, in the
worker thread with the database work: pydantic's own JSON parser is 2.4x faster than
FastAPI's ``json.loads`` plus validation on this shape (0.66 against 1.57 ms for a
50-process snapshot), and a 500-snapshot batch does not stall the event loop while
it is parsed. The schema is still documented (:func:`openapi_schemas`).

Nothing of the body is read before the token is checked (from the headers), and then
at most ``max_body_bytes`` of it, within the server's budget of bytes being parsed at
once (ingest/body.py: 413 or 503 otherwise). The token is confirmed inside the storing
transaction (:func:`confirm_push`), so a request authenticated from this process's
cache of verified tokens still cannot write after the token was revoked anywhere.

A batch that passed validation but that the database refuses to store (a value past a
column's bounds, a constraint) is *quarantined*: the transaction is rolled back, the
request counted as ``quarantined``, and the answer is a 422, on which the agent splits
the batch until it can drop the one snapshot that cannot be stored. Retrying it would
fail the same way forever, and hold the host's newer snapshots behind it. The response is serialised here, once, rather
than validated again and re-encoded by FastAPI's ``response_model`` machinery (which
still documents it).

Each request has a time budget (``ingest_time_budget_seconds``), from the handler's
start (after the token check, before the body is read), because the agent gives up on
an answer after 10 s and work done for a request it gave up on is wasted or repeated.
A request that has spent it by the time it gets a worker thread or its write turn
(queued behind others: a reconnect storm) is answered 503 with ``Retry-After`` and
counted as ``over_budget``, nothing stored. One that spends it while its batch is
applied, when the agent sent :data:`~gpuwatch.wire.PARTIAL_HEADER`, commits the
snapshots done and answers the rest ``deferred`` (counted as ``partial``); without the
header it is stored whole, since an older agent would take ``deferred`` as delivered.

The route resolves its two dependencies itself (:class:`IngestRoute`). This is the one
route that runs hundreds of times a second, and going around FastAPI's dependency
solver and request handler took a single-snapshot push from about 6.6 to 4.8 ms of
server CPU (bench/README.md).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, HTTPException, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool

from gpuwatch.server.database.core import describe
from gpuwatch.server.deps import (
    Context,
    PushCredential,
    PushingAgent,
    ServerContext,
    confirm_push,
    forbid_other_host,
    get_context,
    pushing_agent_of,
    reverify_push,
)
from gpuwatch.server.ingest import service
from gpuwatch.server.ingest.body import (
    SNAPSHOT_BYTE_FACTOR,
    STORE_ERRORS,
    Deadline,
    never_storable,
    over_budget,
    parse_estimate,
    read_body,
    refusal,
    require_json,
)
from gpuwatch.server.metrics import INGEST_RESULT_SCOPE_KEY
from gpuwatch.wire import (
    PARTIAL_DEFERRED,
    PARTIAL_HEADER,
    SNAPSHOTS_PATH,
    IngestRequest,
    IngestResponse,
)

log = logging.getLogger(__name__)


class IngestRoute(APIRoute):
    """An :class:`APIRoute` whose handler calls the endpoint with its dependencies
    (context, credential) resolved directly rather than by FastAPI's solver. The
    endpoint's signature still declares them, so OpenAPI documents the security
    scheme; the endpoint reads its body itself, so there is nothing else to solve."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        async def handle(request: Request) -> Response:
            context = await get_context(request)
            credential = await pushing_agent_of(request, context)
            return await push_snapshots(request, credential, context)

        return handle


router = APIRouter(tags=["ingest"], route_class=IngestRoute)

_ERRORS: dict[int | str, dict[str, str]] = {
    401: {"description": "No bearer token."},
    403: {"description": "Unknown or revoked token, or a token of another host."},
    413: {
        "description": "Body larger than max_body_bytes (refused before it is read when"
        " Content-Length says so), or that would take more memory to parse than the"
        " server allows: send fewer snapshots per request."
    },
    415: {"description": "Content-Type is not application/json."},
    422: {
        "description": "Not a valid batch of snapshots, a clock too far ahead, or a batch"
        " the database cannot store (type `quarantined`): drop the offending snapshot."
    },
    503: {
        "description": "Database unavailable, the server is parsing as much as it may"
        " at once, or the request spent its time budget waiting for its turn; nothing"
        " stored: retry after Retry-After seconds."
    },
}
_PARTIAL_PARAMETER = {
    "name": PARTIAL_HEADER,
    "in": "header",
    "required": False,
    # Any value is valid (a list of tokens; unknown ones are ignored), so the schema
    # does not enumerate it: a request with another value is not malformed.
    "schema": {"type": "string"},
    "description": f"`{PARTIAL_DEFERRED}`: the agent understands a partial answer. When"
    " the request's time budget runs out midway, the snapshots done are stored and the"
    " rest answered `deferred` (send them again). Without it the batch is stored whole.",
}
_BODY = {
    "required": True,
    "content": {"application/json": {"schema": {"$ref": "#/components/schemas/IngestRequest"}}},
}


@router.post(
    SNAPSHOTS_PATH,
    summary="Push a batch of host snapshots",
    response_model=IngestResponse,
    responses=_ERRORS,
    openapi_extra={"requestBody": _BODY, "parameters": [_PARTIAL_PARAMETER]},
)
async def push_snapshots(request: Request, credential: PushingAgent, context: Context) -> Response:
    """Store 1-500 snapshots (an ``IngestRequest``) of the token's host, in one transaction.

    Idempotent per host on ``(agent_id, boot_id, sequence)``: a retried snapshot is
    answered ``duplicate`` and stored once. Nothing is written unless every snapshot
    names the token's host. With ``Gpuwatch-Partial: deferred``, snapshots the request's
    time budget left no time for are answered ``deferred``, not stored.
    """
    budget = context.settings.ingest_time_budget_seconds
    deadline = Deadline.after(budget, clock=context.monotonic)
    partial = _accepts_partial(request)
    try:
        require_json(request)
        with context.bodies.reserve() as reservation:
            raw = await read_body(
                request, limit=context.settings.max_body_bytes, reservation=reservation
            )
            reservation.grow_to(parse_estimate(raw, byte_factor=SNAPSHOT_BYTE_FACTOR))
            response = await run_in_threadpool(_store, raw, credential, context, deadline, partial)
    except HTTPException as err:
        if err.status_code in (413, 415):  # the agent drops on these: 403 comes first
            await run_in_threadpool(reverify_push, context, credential)
        raise
    except _Quarantined as err:
        request.scope[INGEST_RESULT_SCOPE_KEY] = "quarantined"
        raise refusal("quarantined", ("body",), str(err)) from err
    except _OverBudget:
        request.scope[INGEST_RESULT_SCOPE_KEY] = "over_budget"
        raise over_budget(budget) from None
    if response.deferred:
        request.scope[INGEST_RESULT_SCOPE_KEY] = "partial"
    return response.http


def _accepts_partial(request: Request) -> bool:
    """Whether the agent sent ``Gpuwatch-Partial: deferred`` (a list, any case)."""
    values = request.headers.getlist(PARTIAL_HEADER)
    tokens = {token.strip().lower() for value in values for token in value.split(",")}
    return PARTIAL_DEFERRED in tokens


class _Quarantined(Exception):
    """A valid batch the database refused to store: it never will."""


class _OverBudget(Exception):
    """The request's time budget was spent before its batch could start: 503."""


@dataclass(frozen=True)
class _Stored:
    http: Response
    deferred: int


def _store(
    raw: bytearray,
    credential: PushCredential,
    context: ServerContext,
    deadline: Deadline,
    partial: bool,
) -> _Stored:
    identity = credential.identity
    # Queued for a worker thread past the budget: not even parsed, which would cost
    # as much CPU as storing a small batch.
    if deadline.passed():
        raise _OverBudget
    try:
        body = IngestRequest.model_validate_json(raw)
    except ValidationError as err:
        reverify_push(context, credential)
        raise RequestValidationError(err.errors(include_url=False, include_input=False)) from err
    for snapshot in body.snapshots:
        forbid_other_host(identity, snapshot.hostname)
    with context.database.writer() as session:
        confirm_push(session, context, credential)
        # Checked once the write transaction has begun (BEGIN IMMEDIATE on SQLite
        # waits there for writers in other processes): all the queueing is behind us.
        if deadline.passed():
            raise _OverBudget
        try:
            result = service.ingest_snapshots(
                session=session,
                dialect=context.database.dialect,
                host_id=identity.host_id,
                request=body,
                settings=context.settings,
                now=context.clock(),
                cache=context.host_states,
                out_of_time=deadline.passed if partial else None,
            )
            session.commit()
        except service.SnapshotRejected as err:
            raise refusal("clock_skew", ("body", "snapshots", err.index), str(err)) from err
        except STORE_ERRORS as err:
            if not never_storable(err):
                raise
            log.error(
                "host %s: quarantined a batch of %d snapshot(s) the database refused: %s",
                identity.hostname,
                len(body.snapshots),
                describe(err),
                exc_info=err,
            )
            raise _Quarantined(f"the database cannot store this batch: {describe(err)}") from err
    if result.kept is not None:
        context.host_states.put(identity.host_id, result.kept)
    stats = context.stats
    # "accepted" counts what this request stored: applied, or late (stored, not applied).
    stats.count(stats.ingest_snapshots, "accepted", result.accepted)
    stats.count(stats.ingest_snapshots, "duplicate", result.duplicate)
    stats.count(stats.ingest_snapshots, "deferred", result.deferred)
    for kind, n in result.opened.items():
        stats.count(stats.events_opened, kind, n)
    if result.deferred:
        log.debug(
            "host %s: time budget spent, %d of %d snapshot(s) deferred",
            identity.hostname,
            result.deferred,
            len(body.snapshots),
        )
    reply = IngestResponse(
        accepted=result.accepted, duplicate=result.duplicate, results=result.results
    )
    http = Response(reply.model_dump_json(), media_type="application/json")
    return _Stored(http=http, deferred=result.deferred)


def openapi_schemas() -> dict[str, Any]:
    """``IngestRequest`` and the snapshot models it nests, for ``components.schemas``."""
    schema = IngestRequest.model_json_schema(ref_template="#/components/schemas/{model}")
    nested: dict[str, Any] = schema.pop("$defs", {})
    return {**nested, "IngestRequest": schema}
