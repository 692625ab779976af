"""Read API: process history."""

from __future__ import annotations

from fastapi import APIRouter, Query

from gpuwatch.server.deps import Reader, ReadSession
from gpuwatch.server.pagination import MAX_LIMIT, Cursor
from gpuwatch.server.processes import service
from gpuwatch.server.processes.schemas import ProcessPage

router = APIRouter(prefix="/api/v1/processes", tags=["processes"], dependencies=[Reader])


@router.get("", summary="Process history", response_model=ProcessPage)
def list_processes(
    session: ReadSession,
    host: str | None = Query(None, max_length=256, description="Hostname."),
    gpu: int | None = Query(None, ge=0, lt=64, description="GPU index on the host."),
    user: str | None = Query(None, max_length=256),
    at: float | None = Query(None, ge=0, description="Epoch seconds: what held the GPU then."),
    open: bool = Query(False, description="Only processes still holding memory."),
    limit: int = Query(100, ge=1, le=MAX_LIMIT),
    cursor: str | None = Query(None, max_length=200, description="next_cursor of a page."),
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
        cursor=None if cursor is None else Cursor.decode(cursor),
    )
