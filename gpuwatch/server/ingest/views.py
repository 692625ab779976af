"""``POST /api/v1/snapshots``: HTTP in, the ingest writer (ingest/writer.py) out.

The body is read raw here and handed to the writer's thread, which validates it with
``IngestRequest.model_validate_json`` and stores it, in one transaction with whatever
other pushes queued meanwhile: pydantic's own JSON parser is 2.4x faster than
FastAPI's ``json.loads`` plus validation on this shape (0.66 against 1.57 ms for a
50-process snapshot), and a 500-snapshot batch does not stall the event loop while
it is parsed. The schema is still documented (:func:`openapi_schemas`).

Nothing of the body is read before the token is checked (from the headers), and then
at most ``max_body_bytes`` of it, within the server's budget of bytes being parsed at
once and the host's share of it, and within the request's time budget (ingest/body.py:
413, 429 or 503 otherwise). The token is confirmed inside the storing
transaction (:func:`confirm_push`), so a request authenticated from this process's
cache of verified tokens still cannot write after the token was revoked anywhere.

A batch that passed validation but that the database refuses to store (a value past a
column's bounds, a constraint) is *quarantined*: the transaction is rolled back, the
request counted as ``quarantined``, and the answer is a 422, on which the agent splits
the batch until it can drop the one snapshot that cannot be stored. Retrying it would
fail the same way forever, and hold the host's newer snapshots behind it. The response
is serialised by the writer, once, rather than validated again and re-encoded by
FastAPI's ``response_model`` machinery (which still documents it).

Each request has a time budget (``ingest_time_budget_seconds``), from the handler's
start (after the token check, before the body is read), because the agent gives up on
an answer after 10 s and work done for a request it gave up on is wasted or repeated.
A request that has spent it by the time the writer takes it up or it gets its write
turn (queued behind others: a reconnect storm) is answered 503 with ``Retry-After`` and
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
from typing import Any

from fastapi import APIRouter, HTTPException, Request, Response
from fastapi.routing import APIRoute
from starlette.concurrency import run_in_threadpool

from gpuwatch.server.deps import (
    Context,
    PushingAgent,
    get_context,
    pushing_agent_of,
    reverify_push,
)
from gpuwatch.server.ingest.body import (
    SNAPSHOT_BYTE_FACTOR,
    Deadline,
    SlowBody,
    over_budget,
    parse_estimate,
    read_body,
    refusal,
    require_json,
)
from gpuwatch.server.ingest.writer import IngestWriter, OverBudget, Quarantined
from gpuwatch.server.metrics import INGEST_RESULT_SCOPE_KEY
from gpuwatch.wire import (
    PARTIAL_DEFERRED,
    PARTIAL_HEADER,
    PUSH_INTERVAL_HEADER,
    SNAPSHOTS_PATH,
    IngestRequest,
    IngestResponse,
    push_interval_of,
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
    429: {
        "description": "This host already has two requests being read: retry after"
        " Retry-After seconds."
    },
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
        " at once, or the request spent its time budget waiting for its body or its"
        " turn; nothing stored: retry after Retry-After seconds."
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
_PUSH_INTERVAL_PARAMETER = {
    "name": PUSH_INTERVAL_HEADER,
    "in": "header",
    "required": False,
    # Any value is accepted: one outside (0, 3600] seconds is ignored, not refused.
    "schema": {"type": "string"},
    "description": "Seconds between this agent's pushes (0 < s <= 3600). The host's"
    " silence is counted in it (`agent_silent_intervals` of them); without it, in the"
    " server's `agent_push_interval_seconds`.",
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
    openapi_extra={
        "requestBody": _BODY,
        "parameters": [_PARTIAL_PARAMETER, _PUSH_INTERVAL_PARAMETER],
    },
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
        with context.bodies.reserve(credential.identity.host_id) as reservation:
            raw = await read_body(
                request,
                limit=context.settings.max_body_bytes,
                reservation=reservation,
                deadline=deadline,
            )
            reservation.grow_to(parse_estimate(raw, byte_factor=SNAPSHOT_BYTE_FACTOR))
            writer: IngestWriter = request.app.state.ingest_writer
            response = await writer.store(
                raw,
                credential,
                deadline,
                partial,
                push_interval=push_interval_of(request.headers.get(PUSH_INTERVAL_HEADER)),
            )
    except HTTPException as err:
        if err.status_code in (413, 415):  # the agent drops on these: 403 comes first
            await run_in_threadpool(reverify_push, context, credential)
        if isinstance(err, SlowBody):
            request.scope[INGEST_RESULT_SCOPE_KEY] = "slow_body"
        raise
    except Quarantined as err:
        request.scope[INGEST_RESULT_SCOPE_KEY] = "quarantined"
        raise refusal("quarantined", ("body",), str(err)) from err
    except OverBudget:
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


def openapi_schemas() -> dict[str, Any]:
    """``IngestRequest`` and the snapshot models it nests, for ``components.schemas``."""
    schema = IngestRequest.model_json_schema(ref_template="#/components/schemas/{model}")
    nested: dict[str, Any] = schema.pop("$defs", {})
    return {**nested, "IngestRequest": schema}
