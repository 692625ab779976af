"""Read API: hosts and their GPUs."""

from __future__ import annotations

from fastapi import APIRouter, HTTPException, Path, status

from gpuwatch.server.deps import Context, Reader, ReadSession
from gpuwatch.server.hosts import service
from gpuwatch.server.hosts.schemas import HostDetail, HostOut
from gpuwatch.snapshot import NO_NUL

router = APIRouter(prefix="/api/v1/hosts", tags=["hosts"], dependencies=[Reader])


@router.get("", summary="List hosts", response_model=list[HostOut])
def list_hosts(session: ReadSession, context: Context) -> list[HostOut]:
    """Every host with a token, by name, with how recently its agent reported."""
    return service.list_hosts(session=session, settings=context.settings, now=context.clock())


@router.get(
    "/{hostname}",
    summary="One host, its GPUs and current processes",
    response_model=HostDetail,
    responses={404: {"description": "No such host."}},
)
def get_host(
    session: ReadSession, context: Context, hostname: str = Path(max_length=256, pattern=NO_NUL)
) -> HostDetail:
    """The host's GPUs (last reported state) and the processes holding memory now."""
    host = service.get_host(
        session=session, hostname=hostname, settings=context.settings, now=context.clock()
    )
    if host is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, detail=f"no host {hostname!r}")
    return host
