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
a listener on this host) is not checked: the URL names it. The same check guards every
request ``gpuwatch.torch`` sends (:func:`agent_exchange`): a report or an OOM message is
never posted to another user's listener either.

Bounds: this also runs inside training processes (``gpuwatch.torch``), which a stalled
agent must never hold. Every exchange has a deadline on the whole of it and a cap on
the answer's size, and goes to the URL directly, never through a proxy
(:func:`agent_exchange`).

Against the message: a message that names another host gets no view of this one; a GPU
split into MIG instances is matched instance by instance (a process sees only its own);
and in the view, the process that printed the message is marked (never one to stop: a
Jupyter kernel keeps its memory after an OOM), and the PIDs the message blames that are
gone are named (:func:`relate_to_message`).

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
import ssl
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpcore
import httpx
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gpuwatch.doctor.units import format_size
from gpuwatch.snapshot import Gpu, GpuProcess, HostSnapshot, MigInstance

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
    in ``/snapshot`` is used as is. ``timeout`` (seconds) bounds the whole exchange
    (:func:`agent_exchange`), so an absent or stalling agent costs at most that. Never
    raises for an absent, slow or broken agent: connection errors, HTTP errors, an
    answer over :data:`MAX_SNAPSHOT_BYTES` and an invalid body are logged and give
    ``None``. Nor for an untrusted one: a listener on this host owned by another user
    (see the module docstring) is logged at WARNING and gives ``None``. A
    ``transport`` (tests) replaces the socket, so it is not checked.
    """
    problem = agent_url_problem(url)
    if problem is not None:
        log.info("agent URL %r is unusable (%s); continuing without live data", url, problem)
        return None
    target = url.rstrip("/")
    if not target.endswith(SNAPSHOT_PATH):
        target += SNAPSHOT_PATH
    try:
        answer = agent_exchange(
            target, seconds=timeout, max_bytes=MAX_SNAPSHOT_BYTES, transport=transport
        )
    except AgentRefused as err:
        log.warning("%s; no live context", err)
        return None
    except AgentExchangeError as err:
        log.info("no agent at %s (%s); continuing without live data", target, err)
        return None
    if not answer.ok:
        log.warning("agent at %s answered %s; continuing without live data", target, answer.status)
        return None
    try:
        snapshot = HostSnapshot.model_validate_json(answer.body)
    except ValidationError as err:
        log.warning("agent at %s sent an invalid snapshot (%s errors)", target, err.error_count())
        return None
    # Again after: the socket that answered is the one checked.
    if transport is None:
        reason = listener_refusal(target, answered=True)
        if reason is not None:
            log.warning("%s; no live context", reason)
            return None
    return snapshot


def agent_url_problem(url: str) -> str | None:
    """Why ``url`` cannot be the base URL of an agent (``None``: it may be one).

    Checked up front because each of these fails only at the request, and not always
    as an HTTP error: a host name the IDNA codec refuses (an empty label,
    ``gpu-node..cluster``, or one over 63 characters) raises UnicodeError from the
    resolver; and a query or fragment would have the endpoint's path appended after
    it (``http://h:9402?x=1`` + ``/torch``)."""
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, TypeError) as err:
        return str(err)
    if parsed.scheme not in ("http", "https") or not parsed.host:
        return "not an http(s) URL with a host"
    if parsed.query or parsed.fragment or "?" in url or "#" in url:
        return "an agent's base URL has no query (?...) or fragment (#...)"
    try:
        parsed.host.encode("idna")  # what the resolver does with it
    except UnicodeError as err:
        return f"the host name {parsed.host!r} cannot be looked up ({err})"
    return None


# -- one bounded exchange with the agent ------------------------------------------------

# What a training process may hold of one answer: a snapshot of a large host is a few
# MiB; the answers to a POST are a line.
MAX_SNAPSHOT_BYTES = 32 * 2**20
MAX_POST_ANSWER_BYTES = 64 * 2**10


class AgentExchangeError(Exception):
    """Why an exchange with the agent gave no answer, in one line."""


class AgentRefused(AgentExchangeError):
    """The listener behind the URL belongs to a user this process must not talk to."""


@dataclass(frozen=True)
class AgentAnswer:
    status: int
    body: bytes

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300


def agent_exchange(
    url: str,
    *,
    seconds: float,
    max_bytes: int,
    method: str = "GET",
    json_body: bytes | None = None,
    transport: httpx.BaseTransport | None = None,
    check_listener: bool = True,
) -> AgentAnswer:
    """One request to the local agent at ``url``, answered within ``seconds`` in all,
    with at most ``max_bytes`` of body; raises :class:`AgentExchangeError` (and
    nothing else) otherwise, or :class:`AgentRefused` before sending anything to a
    listener on this host that another user owns (:func:`listener_refusal`).

    This runs inside training processes, where a stalled or hostile listener on the
    agent's port must cost a bounded time and memory:

    - the deadline is on the whole exchange (connect, send, every read), not per read
      as httpx's timeouts are: a listener sending a byte every 0.3 s never trips those;
    - the body is read in chunks and dropped past ``max_bytes`` (an answer of 2 GiB is
      never buffered), and a compressed one is refused (none is asked for);
    - no ``httpx.Client``: proxy variables (``HTTP_PROXY``, ``ALL_PROXY``...) are not
      read, so the request goes to the agent on this host and not to a proxy, and a
      malformed one cannot fail it; and httpx's INFO line per request never reaches
      the training job's log (httpcore logs at DEBUG only).

    ``transport`` (tests) replaces the socket: then nothing is checked or bounded in
    time. ``check_listener`` false skips the listener check (a caller that checked it
    moments ago)."""
    if transport is None and check_listener:
        reason = listener_refusal(url, answered=False)
        if reason is not None:
            raise AgentRefused(reason)
    headers = {"Content-Type": "application/json"} if json_body is not None else None
    own = transport is None
    sender = _DeadlineTransport(seconds) if transport is None else transport
    try:
        response = sender.handle_request(
            httpx.Request(method, url, content=json_body, headers=headers)
        )
        try:
            return AgentAnswer(response.status_code, _bounded_body(response, max_bytes))
        finally:
            response.close()
    except AgentExchangeError:
        raise
    except Exception as err:  # a transport, the resolver or the IDNA codec: any failure
        raise AgentExchangeError(_failure(err, seconds)) from None
    finally:
        if own:
            sender.close()


def _bounded_body(response: httpx.Response, max_bytes: int) -> bytes:
    length = response.headers.get("Content-Length", "")
    if length.isascii() and length.isdigit() and int(length) > max_bytes:
        raise AgentExchangeError(f"an answer of {length} bytes, over {max_bytes}")
    if response.headers.get("Content-Encoding", "identity").lower() != "identity":
        raise AgentExchangeError("a compressed answer, which was not asked for")
    chunks, size = [], 0
    for chunk in response.stream:  # type: ignore[union-attr]  # a transport's: sync
        size += len(chunk)
        if size > max_bytes:
            raise AgentExchangeError(f"an answer over {max_bytes} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def _failure(err: Exception, seconds: float) -> str:
    if isinstance(err, httpcore.TimeoutException | httpx.TimeoutException):
        return f"no complete answer within {seconds:g} s"
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0]}" if text else type(err).__name__


class _DeadlineTransport(httpx.BaseTransport):
    """A fresh connection whose every operation must end ``seconds`` from now."""

    def __init__(self, seconds: float) -> None:
        backend = _DeadlineBackend(time.monotonic() + seconds)
        self._pool = httpcore.ConnectionPool(network_backend=backend, max_connections=1)

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        answer = self._pool.handle_request(
            httpcore.Request(
                request.method,
                httpcore.URL(
                    scheme=url.raw_scheme, host=url.raw_host, port=url.port, target=url.raw_path
                ),
                headers=request.headers.raw,
                content=request.content,
            )
        )
        return httpx.Response(answer.status, headers=answer.headers, stream=_Body(answer))

    def close(self) -> None:
        self._pool.close()


class _Body(httpx.SyncByteStream):
    def __init__(self, answer: httpcore.Response) -> None:
        self._answer = answer

    def __iter__(self) -> Iterator[bytes]:
        yield from self._answer.iter_stream()

    def close(self) -> None:
        self._answer.close()


def _left(deadline: float, expired: type[httpcore.TimeoutException]) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise expired("deadline passed")
    return left


class _DeadlineStream(httpcore.NetworkStream):
    """A socket whose reads and writes wait no later than ``deadline`` (monotonic)."""

    def __init__(self, inner: httpcore.NetworkStream, deadline: float) -> None:
        self._inner = inner
        self._deadline = deadline

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self._inner.read(max_bytes, _left(self._deadline, httpcore.ReadTimeout))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._inner.write(buffer, _left(self._deadline, httpcore.WriteTimeout))

    def close(self) -> None:
        self._inner.close()

    def start_tls(
        self,
        ssl_context: ssl.SSLContext,
        server_hostname: str | None = None,
        timeout: float | None = None,
    ) -> httpcore.NetworkStream:
        left = _left(self._deadline, httpcore.ConnectTimeout)
        return _DeadlineStream(
            self._inner.start_tls(ssl_context, server_hostname, left), self._deadline
        )

    def get_extra_info(self, info: str) -> Any:
        return self._inner.get_extra_info(info)


class _DeadlineBackend(httpcore.NetworkBackend):
    def __init__(self, deadline: float) -> None:
        self._inner = httpcore.SyncBackend()
        self._deadline = deadline

    def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[httpcore.SOCKET_OPTION] | None = None,
    ) -> httpcore.NetworkStream:
        left = _left(self._deadline, httpcore.ConnectTimeout)
        stream = self._inner.connect_tcp(host, port, left, local_address, socket_options)
        return _DeadlineStream(stream, self._deadline)

    def sleep(self, seconds: float) -> None:
        self._inner.sleep(seconds)


def listener_refusal(url: str, *, answered: bool, proc_root: Path = Path("/proc")) -> str | None:
    """Why the listener behind ``url`` on this host is not one to talk to (``None``:
    it may be): owned by a uid other than root, the agent's service user or this
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
        return None  # not a URL: the request fails and says so
    found = listeners(port, addresses, proc_root) if addresses else []
    trusted = trusted_uids(os.geteuid())
    for listener in found:
        if listener.uid not in trusted:
            return (
                f"ignoring the agent at {url}: its port belongs to uid {listener.uid}, not "
                f"to root, the {AGENT_SERVICE_USER} service user or you"
            )
    if (
        answered
        and not found
        and any(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses)
    ):
        return (
            f"ignoring the agent at {url}: nothing listens there any more, so who "
            "answered cannot be checked"
        )
    return None


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
    # Judged to be the process that printed the message (its PID, or its memory matches
    # what the message says this process holds): never offered to stop. A Jupyter kernel
    # keeps its memory after an OOM, so the one that failed is often still on the GPU.
    probably_this_process: bool = False


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
    # The MIG instance the message is about ("3g.40gb"), when the GPU is split: the view
    # is of that instance (its memory and its processes: instances share no memory).
    mig_profile: str | None = None
    # PIDs the message lists as holding memory that are not on this GPU now: exited since
    # (or in a PID namespace the agent does not see).
    absent_message_pids: list[int] = Field(default_factory=list)


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
    named_targets = _targets([named]) if named is not None and not named.lost else []
    on_named = [t for t in named_targets if same_card(total_bytes, t.total)]
    if len(on_named) == 1:
        target = on_named[0]
        note = None
        if target.instance is not None:
            note = f"this message is from a {format_size(total_bytes)} card: {target.describe()}"
        return LiveMatch(target.view(snapshot, clock), note)
    matching = [t for t in _targets(usable) if same_card(total_bytes, t.total)]
    card = f"this message is from a {format_size(total_bytes)} card"
    if named is not None and named.memory_total_bytes:
        here = f"this host's GPU {named.index} has {format_size(named.memory_total_bytes)}"
        if named.mig_instances:
            sizes = ", ".join(t.label() for t in named_targets)
            here += f" split into MIG instances ({sizes or 'of unknown sizes'})"
    else:
        sizes = ", ".join(f"GPU {g.index} {format_size(g.memory_total_bytes or 0)}" for g in usable)
        here = f"this host has {sizes or 'no GPU with a known size'}"
    if len(matching) == 1:
        other = matching[0]
        return LiveMatch(
            other.view(snapshot, clock),
            f"{card}; {here}: showing {other.label()}, the only "
            f"{'MIG instance' if other.instance is not None else 'GPU'} here of that size "
            "(CUDA_VISIBLE_DEVICES renumbers GPUs from 0)",
        )
    if matching:
        return LiveMatch(
            None,
            f"{card}; {here}, and {', '.join(t.label() for t in matching)} are that "
            "size: live context not attached (which one is ambiguous)",
        )
    return LiveMatch(None, f"{card}; {here}: live context not attached")


@dataclass(frozen=True)
class _Target:
    """What one CUDA device on this host can be: a whole GPU, or one MIG instance of it
    (a process on a MIG-enabled GPU sees only its instance's memory)."""

    gpu: Gpu
    instance: MigInstance | None = None

    @property
    def total(self) -> int:
        holder = self.instance if self.instance is not None else self.gpu
        return holder.memory_total_bytes or 0

    def label(self) -> str:
        if self.instance is None:
            return f"GPU {self.gpu.index} ({format_size(self.total)})"
        return (
            f"GPU {self.gpu.index}'s MIG instance {self.instance.profile or self.instance.index} "
            f"({format_size(self.total)})"
        )

    def describe(self) -> str:
        return (
            f"showing {self.label()}, the MIG instance of that size, and only its processes "
            "(MIG instances share no memory)"
        )

    def view(self, snapshot: HostSnapshot, now: float) -> LiveGpu:
        whole = _view(snapshot.hostname, self.gpu, snapshot.collected_at, now)
        instance = self.instance
        if instance is None:
            return whole
        mine = {
            p.pid
            for p in self.gpu.processes
            if p.gpu_instance_id is not None and p.gpu_instance_id == instance.gpu_instance_id
        }
        used = instance.memory_used_bytes
        total = instance.memory_total_bytes
        return whole.model_copy(
            update={
                "processes": [p for p in whole.processes if p.pid in mine],
                "memory_total_bytes": total,
                "memory_used_bytes": used,
                "memory_free_bytes": None
                if used is None or total is None
                else max(0, total - used),
                "mig_profile": instance.profile or instance.name,
            }
        )


def _targets(gpus: Iterable[Gpu]) -> list[_Target]:
    """Each device a process may have been given: a GPU, or each MIG instance of one."""
    targets: list[_Target] = []
    for gpu in gpus:
        if gpu.lost:
            continue
        if gpu.mig_instances:
            targets.extend(_Target(gpu, m) for m in gpu.mig_instances if m.memory_total_bytes)
        elif gpu.memory_total_bytes:
            targets.append(_Target(gpu))
    return targets


# A live process is the one that printed the message when its memory is what the message
# says this process held, within this much (NVML's figure moves as the allocator frees and
# the context grows; the message's is printed to 10 MiB) ...
THIS_PROCESS_MATCH_BYTES = 256 * 2**20
THIS_PROCESS_MATCH_SHARE = 0.02
# ... or, where the message gives only PyTorch's reserve, when it holds that reserve plus
# at most this much outside PyTorch (a CUDA context, cuBLAS/cuDNN workspaces).
OUTSIDE_RESERVE_BYTES = 2 * 2**30


def same_host(message_host: str, hostname: str) -> bool:
    """Whether the host a message names (NCCL's ``host:pid:tid`` prefix, Slurm's node) is
    the agent's: the same first label, in any case (one may be fully qualified)."""
    first = message_host.strip().lower().split(".")[0]
    return first in ("", "localhost", hostname.strip().lower().split(".")[0])


@dataclass(frozen=True)
class MessageProcesses:
    """What an OOM message says about the processes on its GPU, to compare with the view."""

    listed: tuple[int, ...] = ()  # the PIDs of its "Process N has ..." list
    this_process_pids: frozenset[int] = frozenset()  # listed, or printed, PIDs judged ours
    this_process_bytes: int | None = None  # "this process has X memory in use"
    reserved_bytes: int | None = None  # PyTorch's reserve, where "this process" is unknown


def relate_to_message(gpu: LiveGpu, message: MessageProcesses) -> LiveGpu:
    """``gpu`` with the process that printed the message marked, and the PIDs the message
    lists that are no longer on it named."""
    listed = set(message.listed)
    processes = [
        p.model_copy(update={"probably_this_process": True})
        if _is_this_process(p, message, listed)
        else p
        for p in gpu.processes
    ]
    here = {p.pid for p in gpu.processes}
    absent = [
        pid for pid in message.listed if pid not in here and pid not in message.this_process_pids
    ]
    return gpu.model_copy(update={"processes": processes, "absent_message_pids": absent})


def _is_this_process(process: LiveProcess, message: MessageProcesses, listed: set[int]) -> bool:
    if process.pid in message.this_process_pids:
        return True
    if process.pid in listed or process.used_bytes is None:
        return False  # the message names it as a neighbour
    used, ours = process.used_bytes, message.this_process_bytes
    if ours is not None:
        return abs(used - ours) <= max(THIS_PROCESS_MATCH_BYTES, THIS_PROCESS_MATCH_SHARE * ours)
    reserved = message.reserved_bytes
    return reserved is not None and reserved <= used <= reserved + OUTSIDE_RESERVE_BYTES


def room_now(gpu: LiveGpu, requested: int | None, *, margin: int) -> str | None:
    """A note when the GPU has room for the failed request now, or ``None``."""
    free = gpu.memory_free_bytes
    if free is None or requested is None or free < requested + margin:
        return None
    where = f"MIG instance {gpu.mig_profile}" if gpu.mig_profile else f"GPU {gpu.index}"
    return (
        f"right now {format_size(free)} of {where} is free (live view), enough for the "
        f"{format_size(requested)} request: what held the memory then has let go of it, so "
        "a retry may succeed before anything is stopped"
    )


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
