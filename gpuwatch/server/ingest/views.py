"""``POST /api/v1/snapshots``: HTTP in, :func:`ingest_snapshots` out.

The body is read raw and validated with ``IngestRequest.model_validate_json``, in the
worker thread with the database work: pydantic's own JSON parser is 2.4x faster than
FastAPI's ``json.loads`` plus validation on this shape (0.66 against 1.57 ms for a
50-process snapshot), and a 500-snapshot batch does not stall the event loop while
it is parsed. The schema is still documented (:func:`openapi_schemas`).

The token is confirmed inside the storing transaction (:func:`confirm_push`), so a
request authenticated from this process's cache of verified tokens still cannot write
after the token was revoked anywhere. The response is serialised here, once, rather
than validated again and re-encoded by FastAPI's ``response_model`` machinery (which
still documents it).

The route resolves its two dependencies itself (:class:`IngestRoute`). This is the one
route that runs hundreds of times a second, and going around FastAPI's dependency
solver and request handler took a single-snapshot push from about 6.6 to 4.8 ms of
server CPU (bench/README.md).
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import APIRouter, HTTPException, Request, Response, status
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool

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
from gpuwatch.wire import SNAPSHOTS_PATH, IngestRequest, IngestResponse


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
    413: {"description": "Body larger than max_body_bytes (refused before it is read)."},
    415: {"description": "Content-Type is not application/json."},
    422: {"description": "Not a valid batch of snapshots."},
    503: {"description": "Database unavailable; retry after Retry-After seconds."},
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
    openapi_extra={"requestBody": _BODY},
)
async def push_snapshots(request: Request, credential: PushingAgent, context: Context) -> Response:
    """Store 1-500 snapshots (an ``IngestRequest``) of the token's host, in one transaction.

    Idempotent on ``(agent_id, boot_id, sequence)``: a retried snapshot is answered
    ``duplicate`` and stored once. Nothing is written unless every snapshot names the
    token's host.
    """
    media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media_type != "application/json":
        await run_in_threadpool(reverify_push, context, credential)  # 403 comes first
        raise HTTPException(status.HTTP_415_UNSUPPORTED_MEDIA_TYPE, detail="send application/json")
    raw = await request.body()  # bounded by the app's max_body_size
    return await run_in_threadpool(_store, raw, credential, context)


def _store(raw: bytes, credential: PushCredential, context: ServerContext) -> Response:
    identity = credential.identity
    try:
        body = IngestRequest.model_validate_json(raw)
    except ValidationError as err:
        reverify_push(context, credential)
        raise RequestValidationError(err.errors(include_url=False, include_input=False)) from err
    for snapshot in body.snapshots:
        forbid_other_host(identity, snapshot.hostname)
    with context.database.writer() as session:
        confirm_push(session, context, credential)
        try:
            result = service.ingest_snapshots(
                session=session,
                dialect=context.database.dialect,
                host_id=identity.host_id,
                request=body,
                settings=context.settings,
                now=context.clock(),
                cache=context.host_states,
            )
        except service.SnapshotRejected as err:
            raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, detail=str(err)) from err
        session.commit()
    if result.kept is not None:
        context.host_states.put(identity.host_id, result.kept)
    stats = context.stats
    stats.count(stats.ingest_snapshots, "accepted", result.accepted)
    stats.count(stats.ingest_snapshots, "duplicate", result.duplicate)
    for kind, n in result.opened.items():
        stats.count(stats.events_opened, kind, n)
    reply = IngestResponse(
        accepted=result.accepted, duplicate=result.duplicate, results=result.results
    )
    return Response(reply.model_dump_json(), media_type="application/json")


def openapi_schemas() -> dict[str, Any]:
    """``IngestRequest`` and the snapshot models it nests, for ``components.schemas``."""
    schema = IngestRequest.model_json_schema(ref_template="#/components/schemas/{model}")
    nested: dict[str, Any] = schema.pop("$defs", {})
    return {**nested, "IngestRequest": schema}
