"""Read API: hosts and their GPUs."""

from __future__ import annotations

from urllib.parse import quote, unquote

from fastapi import APIRouter, HTTPException, Path, Request, status

from gpuwatch.server.deps import Context, Reader, ReadSession
from gpuwatch.server.hosts import service
from gpuwatch.server.hosts.schemas import HostDetail, HostOut
from gpuwatch.snapshot import NO_NUL

router = APIRouter(prefix="/api/v1/hosts", tags=["hosts"], dependencies=[Reader])


def spelled_segments(request: Request, tail: str) -> list[str]:
    """The segments of ``tail`` (the end of the request's path, as Starlette decoded it)
    split where the client wrote a "/", then each percent-decoded.

    A hostname may hold "/" (agents send any text), and Starlette routes on the decoded
    path, where "a%2Fgpus%2F1" (one host) and "a/gpus/1" (GPU 1 of host "a") are the
    same string. The raw path still tells them apart: its end that decodes to ``tail``
    is found from the right (a root path may stand before it). A server that gives no
    raw path, or a proxy that decoded it already, leaves only the decoded path to split.
    A tail longer than any address (a 256-character name, a GPU) is one segment, so
    the search stays cheap; it names no host."""
    if len(tail) > _LONGEST_TAIL:
        return [tail]
    raw = request.scope.get("raw_path")
    spelled = quote(tail, safe="/")
    if raw is not None:
        raw_path = raw.decode("latin-1")
        # Each "/" the client wrote is one in ``tail`` too: the end sought starts after
        # one of the last few.
        slash = raw_path.rfind("/")
        for _ in range(tail.count("/") + 1):
            if slash < 0:
                break
            if unquote(raw_path[slash + 1 :]) == tail:
                spelled = raw_path[slash + 1 :]
                break
            slash = raw_path.rfind("/", 0, slash)
    return [unquote(segment) for segment in spelled.split("/")]


# A hostname (256 characters, as an agent can send) and "/gpus/" and a GPU index, with room.
_LONGEST_TAIL = 300


@router.get("", summary="List hosts", response_model=list[HostOut])
def list_hosts(session: ReadSession, context: Context) -> list[HostOut]:
    """Every host with a token, by name, with how recently its agent reported."""
    return service.list_hosts(session=session, settings=context.settings, now=context.clock())


@router.get(
    "/{hostname:path}",
    summary="One host, its GPUs and current processes",
    response_model=HostDetail,
    responses={404: {"description": "No such host."}},
)
def get_host(
    request: Request,
    session: ReadSession,
    context: Context,
    hostname: str = Path(max_length=256, pattern=NO_NUL),
) -> HostDetail:
    """The host's GPUs (last reported state) and the processes holding memory now.
    Percent-encode the hostname as one path segment ("/" as ``%2F``)."""
    segments = spelled_segments(request, hostname)
    host = (
        service.get_host(
            session=session, hostname=segments[0], settings=context.settings, now=context.clock()
        )
        if len(segments) == 1
        else None
    )
    if host is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, detail=f"no host {hostname!r}")
    return host
