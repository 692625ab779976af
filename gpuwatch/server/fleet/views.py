"""Read API: the fleet summary."""

from __future__ import annotations

from fastapi import APIRouter

from gpuwatch.server.deps import Context, Reader, ReadSession
from gpuwatch.server.fleet import service
from gpuwatch.server.fleet.schemas import FleetOut

router = APIRouter(prefix="/api/v1/fleet", tags=["fleet"], dependencies=[Reader])


@router.get("", summary="Fleet summary", response_model=FleetOut)
def fleet(session: ReadSession, context: Context) -> FleetOut:
    """GPUs by fullness, memory held by orphans and idle holders, silent hosts."""
    return service.fleet_summary(session=session, settings=context.settings, now=context.clock())
