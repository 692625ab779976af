"""Who is on the GPU right now, from the local agent's ``GET /snapshot``.

``gpuwatch explain`` and ``gpuwatch fit --gpu local`` ask the agent on this host (the
same :class:`~gpuwatch.snapshot.HostSnapshot` that ``gpuwatch status --json`` prints).
No agent is a normal case, not an error: :func:`fetch_local_snapshot` then returns
``None`` and the doctor works from the message alone.

Who answers: anyone may listen on the agent's port while the agent is down and serve
a made-up snapshot (whose advice then names any PID). So a snapshot from this host is
used only when the socket behind the URL belongs to root, the agent's service user or
the caller, checked before and after the request as ``gpuwatch reap`` checks its
history (:mod:`gpuwatch.agent.reaper.served`); otherwise it is ignored, with one
warning line. An agent on another host (a URL that is neither a loopback address nor
a listener on this host) is not checked: the URL names it.

Idle time: a snapshot is one instant. It has each process's SM share *now*
(``sm_ratio``) and its start time, not how long it has been idle, so
:class:`LiveProcess` reports ``running_seconds`` and ``sm_ratio`` and leaves
``idle_seconds`` ``None``; the server's idle detector, which sees the history, owns
that figure.
"""

from __future__ import annotations

import ipaddress
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import httpx
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gpuwatch.doctor.units import format_size
from gpuwatch.snapshot import Gpu, GpuProcess, HostSnapshot

log = logging.getLogger(__name__)

# The total an OOM message prints (cudaMemGetInfo, or the allocator's device limit) is a
# little below NVML's: 23.65 GiB on an RTX 4090 whose NVML total is 23.99 GiB (98.6 %),
# 39.39 GiB on a 40 GiB A100, 79.19 GiB on an 80 GiB H100. Within this band it is the
# same model of card; outside it, another card (11 vs 12 GiB cards differ by 8 %).
SAME_CARD_LOW_RATIO = 0.93
SAME_CARD_HIGH_RATIO = 1.02
# The device types of a message that may be about a GPU the agent (NVML) sees: CUDA,
# and TensorFlow's and XLA's "GPU" (their GPU builds are CUDA ones). Any other (ROCm,
# Intel, Apple, TPU, Ascend NPU and the other out-of-tree devices) is on hardware the
# agent never sees, and host memory is no GPU's: none is attached.
NVIDIA_DEVICE_TYPES = frozenset({"cuda", "gpu"})

SNAPSHOT_PATH = "/snapshot"


def fetch_local_snapshot(
    url: str, *, timeout: float = 0.5, transport: httpx.BaseTransport | None = None
) -> HostSnapshot | None:
    """The agent's current snapshot, or ``None`` when no usable agent answers.

    ``url`` is the agent's base URL (``http://127.0.0.1:9402``); a URL already ending
    in ``/snapshot`` is used as is. ``timeout`` (seconds) bounds connect and read, so
    an absent agent costs at most that. Never raises for an absent, slow or broken
    agent: connection errors, HTTP errors and an invalid body are logged and give
    ``None``. Nor for an untrusted one: a listener on this host owned by another user
    (see the module docstring) is logged at WARNING and gives ``None``. A
    ``transport`` (tests) replaces the socket, so it is not checked.
    """
    target = url.rstrip("/")
    if not target.endswith(SNAPSHOT_PATH):
        target += SNAPSHOT_PATH
    if transport is None and _untrusted(target, answered=False):
        return None
    try:
        with httpx.Client(timeout=timeout, transport=transport) as client:
            response = client.get(target)
            response.raise_for_status()
            snapshot = HostSnapshot.model_validate_json(response.content)
        # Again after: the socket that answered is the one checked.
        if transport is None and _untrusted(target, answered=True):
            return None
        return snapshot
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


def _untrusted(url: str, *, answered: bool, proc_root: Path = Path("/proc")) -> bool:
    """True (and one warning logged) when the listener behind ``url`` on this host is
    not one to trust: owned by a uid other than root, the agent's service user or this
    caller; or, once it ``answered``, gone from a loopback address (nothing to check)."""
    from gpuwatch.agent.reaper.served import (
        AGENT_SERVICE_USER,
        listeners,
        trusted_uids,
        url_addresses,
    )

    try:
        addresses, port = url_addresses(url)
    except ValueError:
        return False  # not a URL: the request fails and says so
    found = listeners(port, addresses, proc_root) if addresses else []
    trusted = trusted_uids(os.geteuid())
    for listener in found:
        if listener.uid not in trusted:
            log.warning(
                "ignoring the agent at %s: its port belongs to uid %s, not to root, the "
                "%s service user or you; no live context",
                url,
                listener.uid,
                AGENT_SERVICE_USER,
            )
            return True
    if (
        answered
        and not found
        and any(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses)
    ):
        log.warning(
            "ignoring the agent at %s: nothing listens there any more, so who answered "
            "cannot be checked; no live context",
            url,
        )
        return True
    return False


class LiveProcess(BaseModel):
    """One process on the GPU as the agent sees it now."""

    model_config = ConfigDict(extra="forbid")

    pid: int
    user: str | None = None
    uid: int | None = None
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
    # False when nothing ties the message to this GPU (it printed no card size to
    # check): the view is shown, but no command to kill what is on it.
    confirmed: bool = True


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


@dataclass(frozen=True)
class LiveMatch:
    """The local GPU an OOM message is about, or why none is shown (``note``)."""

    gpu: LiveGpu | None
    note: str | None = None


def same_card(message_total: int, local_total: int) -> bool:
    """True when a message's total and NVML's total are the same size of card."""
    return SAME_CARD_LOW_RATIO * local_total <= message_total <= SAME_CARD_HIGH_RATIO * local_total


def match_live_gpu(
    snapshot: HostSnapshot,
    index: int | None,
    *,
    total_bytes: int | None,
    device_type: str | None = None,
    now: float | None = None,
) -> LiveMatch:
    """The live view of the GPU the message is about, checked against its size.

    The index a message prints is the process's own (``CUDA_VISIBLE_DEVICES``
    renumbers from 0), and the message may come from another machine, so a local GPU
    is attached only when its total matches the message's ``total_bytes``. When it
    does not, the one local GPU of the message's size is shown instead (with a note);
    with none, or several, none is attached and the note says why.
    """
    clock = snapshot.collected_at if now is None else now
    if device_type in ("host", "cpu"):
        return LiveMatch(None, "this message is about host memory: no GPU's live context applies")
    if device_type is not None and device_type not in NVIDIA_DEVICE_TYPES:
        return LiveMatch(
            None,
            f"this message is about {device_type.upper()} memory; this host's agent sees "
            "NVIDIA GPUs: live context not attached",
        )
    if total_bytes is None:
        gpu = live_gpu(snapshot, index, now=clock)
        if gpu is None:
            return LiveMatch(None)
        return LiveMatch(
            gpu.model_copy(update={"confirmed": False}),
            f"the message gives no card size, so nothing confirms it is about this host's "
            f"GPU {gpu.index} (it may come from another machine, and CUDA_VISIBLE_DEVICES "
            "renumbers GPUs from 0): check before stopping anything",
        )
    usable = [g for g in snapshot.gpus if not g.lost and g.memory_total_bytes]
    named = snapshot.gpu(index) if index is not None else (usable[0] if len(usable) == 1 else None)
    if (
        named is not None
        and named.memory_total_bytes
        and same_card(total_bytes, named.memory_total_bytes)
    ):
        return LiveMatch(_view(snapshot.hostname, named, snapshot.collected_at, clock))
    matching = [g for g in usable if same_card(total_bytes, g.memory_total_bytes or 0)]
    card = f"this message is from a {format_size(total_bytes)} card"
    if named is not None and named.memory_total_bytes:
        here = f"this host's GPU {named.index} has {format_size(named.memory_total_bytes)}"
    else:
        sizes = ", ".join(f"GPU {g.index} {format_size(g.memory_total_bytes or 0)}" for g in usable)
        here = f"this host has {sizes or 'no GPU with a known size'}"
    if len(matching) == 1:
        other = matching[0]
        return LiveMatch(
            _view(snapshot.hostname, other, snapshot.collected_at, clock),
            f"{card}; {here}: showing GPU {other.index} "
            f"({format_size(other.memory_total_bytes or 0)}), the only GPU here of that size "
            "(CUDA_VISIBLE_DEVICES renumbers GPUs from 0)",
        )
    if matching:
        return LiveMatch(
            None,
            f"{card}; {here}, and GPUs {', '.join(str(g.index) for g in matching)} are that "
            "size: live context not attached (which one is ambiguous)",
        )
    return LiveMatch(None, f"{card}; {here}: live context not attached")


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
        uid=process.owner.uid,
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
