"""Read API: process history."""

from __future__ import annotations

from fastapi import APIRouter, HTTPException, Path, Query, status

from gpuwatch.server.deps import Context, Reader, ReadSession
from gpuwatch.server.pagination import MAX_LIMIT, Cursor, refuse_reversed_range
from gpuwatch.server.processes import service
from gpuwatch.server.processes.schemas import ProcessPage, ProcessSamples
from gpuwatch.snapshot import NO_NUL

# A week of samples at the default 60 s interval.
MAX_SAMPLES = 10080

router = APIRouter(prefix="/api/v1/processes", tags=["processes"], dependencies=[Reader])


@router.get("", summary="Process history", response_model=ProcessPage)
def list_processes(
    session: ReadSession,
    host: str | None = Query(None, max_length=256, pattern=NO_NUL, description="Hostname."),
    gpu: int | None = Query(None, ge=0, lt=64, description="GPU index on the host."),
    user: str | None = Query(None, max_length=256, pattern=NO_NUL),
    at: float | None = Query(
        None, ge=0, allow_inf_nan=False, description="Epoch seconds: what held the GPU then."
    ),
    open: bool = Query(False, description="Only processes still holding memory."),
    limit: int = Query(100, ge=1, le=MAX_LIMIT),
    cursor: str | None = Query(
        None, max_length=200, pattern=NO_NUL, description="next_cursor of a page."
    ),
) -> ProcessPage:
    """Process lifetimes, newest first, e.g. "what was on host-3 GPU 2 at 14:05"."""
    return service.list_processes(
        session=session,
        hostname=host,
        gpu_index=gpu,
        user=user,
        at=at,
        open_only=open,
        limit=limit,
        cursor=None if cursor is None else Cursor.decode(cursor, of=service.PROCESSES),
    )


@router.get(
    "/{lifetime_id}/samples",
    summary="Samples of one process lifetime",
    response_model=ProcessSamples,
    responses={404: {"description": "No lifetime of that id."}},
)
def process_samples(
    session: ReadSession,
    context: Context,
    lifetime_id: int = Path(ge=1, le=2**62, description="The id of a lifetime (GET /processes)."),
    since: float | None = Query(
        None,
        ge=0,
        allow_inf_nan=False,
        description="Epoch seconds: buckets starting then or later.",
    ),
    until: float | None = Query(
        None, ge=0, allow_inf_nan=False, description="Epoch seconds: buckets starting before then."
    ),
    limit: int = Query(1440, ge=1, le=MAX_SAMPLES, description="At most this many, the newest."),
) -> ProcessSamples:
    """A lifetime's coarse per-bucket samples (floor and peak bytes, busiest SM), oldest
    first: the history the reaper reads when the local agent's is shorter. ``until``
    before ``since`` is a 422."""
    refuse_reversed_range(since, until)
    found = service.process_samples(
        session=session,
        lifetime_id=lifetime_id,
        sample_interval_seconds=context.settings.sample_interval_seconds,
        since=since,
        until=until,
        limit=limit,
    )
    if found is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, detail=f"no process lifetime {lifetime_id}")
    return found
