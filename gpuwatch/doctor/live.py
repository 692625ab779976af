"""Who is on the GPU right now, from the local agent's ``GET /snapshot``.

``gpuwatch explain`` and ``gpuwatch fit --gpu local`` ask the agent on this host (the
same :class:`~gpuwatch.snapshot.HostSnapshot` that ``gpuwatch status --json`` prints).
No agent is a normal case, not an error: :func:`fetch_local_snapshot` then returns
``None`` and the doctor works from the message alone.

Idle time: a snapshot is one instant. It has each process's SM share *now*
(``sm_ratio``) and its start time, not how long it has been idle, so
:class:`LiveProcess` reports ``running_seconds`` and ``sm_ratio`` and leaves
``idle_seconds`` ``None``; the server's idle detector, which sees the history, owns
that figure.
"""

from __future__ import annotations

import logging

import httpx
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gpuwatch.snapshot import Gpu, GpuProcess, HostSnapshot

log = logging.getLogger(__name__)

SNAPSHOT_PATH = "/snapshot"


def fetch_local_snapshot(
    url: str, *, timeout: float = 0.5, transport: httpx.BaseTransport | None = None
) -> HostSnapshot | None:
    """The agent's current snapshot, or ``None`` when no usable agent answers.

    ``url`` is the agent's base URL (``http://127.0.0.1:9402``); a URL already ending
    in ``/snapshot`` is used as is. ``timeout`` (seconds) bounds connect and read, so
    an absent agent costs at most that. Never raises for an absent, slow or broken
    agent: connection errors, HTTP errors and an invalid body are logged and give
    ``None``.
    """
    target = url.rstrip("/")
    if not target.endswith(SNAPSHOT_PATH):
        target += SNAPSHOT_PATH
    try:
        with httpx.Client(timeout=timeout, transport=transport) as client:
            response = client.get(target)
            response.raise_for_status()
            return HostSnapshot.model_validate_json(response.content)
    except httpx.HTTPStatusError as err:
        log.warning(
            "agent at %s answered %s; continuing without live data",
            target,
            err.response.status_code,
        )
    except (httpx.HTTPError, httpx.InvalidURL) as err:
        log.info("no agent at %s (%s); continuing without live data", target, err)
    except ValidationError as err:
        log.warning("agent at %s sent an invalid snapshot (%s errors)", target, err.error_count())
    return None


class LiveProcess(BaseModel):
    """One process on the GPU as the agent sees it now."""

    model_config = ConfigDict(extra="forbid")

    pid: int
    user: str | None = None
    name: str | None = None
    command: str | None = None
    used_bytes: int | None = None
    sm_ratio: float | None = None  # SM share at this instant, 0..1
    running_seconds: float | None = None  # now - start_time
    idle_seconds: float | None = None  # not in a snapshot yet (see module docstring)
    jupyter_kernel: bool = False
    orphaned: bool = False
    container_id: str | None = None
    torch_allocated_bytes: int | None = None
    torch_reserved_bytes: int | None = None


class LiveGpu(BaseModel):
    """One GPU and its processes at ``collected_at``, largest holder first."""

    model_config = ConfigDict(extra="forbid")

    hostname: str
    index: int
    name: str | None = None
    memory_total_bytes: int | None = None
    memory_used_bytes: int | None = None
    memory_free_bytes: int | None = None
    collected_at: float
    processes: list[LiveProcess] = Field(default_factory=list)


def live_gpu(
    snapshot: HostSnapshot, index: int | None, *, now: float | None = None
) -> LiveGpu | None:
    """The view of GPU ``index`` in ``snapshot``; with ``index`` unknown, the only GPU.

    Returns ``None`` when that GPU is not in the snapshot (or the index is unknown on
    a multi-GPU host: guessing would blame the wrong people).
    """
    if index is None:
        gpu = snapshot.gpus[0] if len(snapshot.gpus) == 1 else None
    else:
        gpu = snapshot.gpu(index)
    if gpu is None:
        return None
    clock = snapshot.collected_at if now is None else now
    return _view(snapshot.hostname, gpu, snapshot.collected_at, clock)


def _view(hostname: str, gpu: Gpu, collected_at: float, now: float) -> LiveGpu:
    processes = sorted(
        (_process(p, now) for p in gpu.processes),
        key=lambda p: p.used_bytes or 0,
        reverse=True,
    )
    return LiveGpu(
        hostname=hostname,
        index=gpu.index,
        name=gpu.name,
        memory_total_bytes=gpu.memory_total_bytes,
        memory_used_bytes=gpu.memory_used_bytes,
        memory_free_bytes=gpu.memory_free_bytes,
        collected_at=collected_at,
        processes=processes,
    )


def _process(process: GpuProcess, now: float) -> LiveProcess:
    running = None if process.start_time is None else max(0.0, now - process.start_time)
    return LiveProcess(
        pid=process.pid,
        user=process.owner.user,
        name=process.name,
        command=process.command,
        used_bytes=process.used_bytes,
        sm_ratio=process.sm_ratio,
        running_seconds=running,
        jupyter_kernel=process.jupyter_kernel,
        orphaned=process.orphaned,
        container_id=process.owner.container_id,
        torch_allocated_bytes=process.torch.allocated_bytes if process.torch else None,
        torch_reserved_bytes=process.torch.reserved_bytes if process.torch else None,
    )
