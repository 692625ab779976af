"""``POST /api/v1/snapshots``: HTTP in, :func:`ingest_snapshots` out."""

from __future__ import annotations

from fastapi import APIRouter, HTTPException, status

from gpuwatch.server.deps import Agent, Context, WriteSession, forbid_other_host
from gpuwatch.server.ingest import service
from gpuwatch.server.ingest.schemas import IngestRequest, IngestResponse

router = APIRouter(tags=["ingest"])

_ERRORS: dict[int | str, dict[str, str]] = {
    401: {"description": "No bearer token."},
    403: {"description": "Unknown or revoked token, or a token of another host."},
    413: {"description": "Body larger than max_body_bytes (refused before it is read)."},
    422: {"description": "Not a valid batch of snapshots."},
    503: {"description": "Database unavailable; retry after Retry-After seconds."},
}


@router.post(
    "/api/v1/snapshots",
    summary="Push a batch of host snapshots",
    response_model=IngestResponse,
    responses=_ERRORS,
)
def push_snapshots(
    body: IngestRequest, identity: Agent, session: WriteSession, context: Context
) -> IngestResponse:
    """Store 1-500 snapshots of the token's host, in one transaction.

    Idempotent on ``(agent_id, boot_id, sequence)``: a retried snapshot is answered
    ``duplicate`` and stored once. Nothing is written unless every snapshot names the
    token's host.
    """
    for snapshot in body.snapshots:
        forbid_other_host(identity, snapshot.hostname)
    try:
        result = service.ingest_snapshots(
            session=session,
            dialect=context.database.dialect,
            host_id=identity.host_id,
            request=body,
            settings=context.settings,
            now=context.clock(),
        )
    except service.SnapshotRejected as err:
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, detail=str(err)) from err
    session.commit()
    stats = context.stats
    stats.count(stats.ingest_snapshots, "accepted", result.accepted)
    stats.count(stats.ingest_snapshots, "duplicate", result.duplicate)
    for kind, n in result.opened.items():
        stats.count(stats.events_opened, kind, n)
    return IngestResponse(
        accepted=result.accepted, duplicate=result.duplicate, results=result.results
    )
