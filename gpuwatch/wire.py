"""The wire contract: every body that crosses a process boundary, its path and its limits.

Both ends of each link import their models from here, so a field cannot be renamed on
one side only. The snapshot itself is :class:`~gpuwatch.snapshot.HostSnapshot`; this
module holds the envelopes around it and the other bodies:

* agent -> server, ``POST /api/v1/snapshots``: :class:`IngestRequest`, answered with
  :class:`IngestResponse` (partially, with ``deferred`` items, only to a request that
  carries :data:`PARTIAL_HEADER`);
* agent -> server, ``POST /api/v1/events`` (an OOM it relays, a process its reaper
  killed): :class:`ReportedEvent`, answered with :class:`ReportedEventResult`;
* ``gpuwatch.torch`` -> the local agent, ``POST /torch``: :class:`TorchReport`;
* ``gpuwatch.torch`` -> the local agent, ``POST /incidents/oom``: :class:`OomIncident`.

Sizes are bytes, times Unix epoch seconds. Bodies are strict (``extra="forbid"``) and
bounded, because each side takes them from another process: every number fits the
column that stores it, no float is NaN or infinite, and no string holds NUL (refused,
not stripped; see :data:`~gpuwatch.snapshot.NO_NUL`), and every integer, number and
boolean is one (never ``true`` for 1 or ``"7"`` for 7; see
:data:`~gpuwatch.snapshot.JSON_INTEGER`). Free-form JSON (an event's
``evidence``, an incident's ``explanation``) is bounded in bytes and depth. The answers
(:class:`IngestResponse`, :class:`ReportedEventResult`) ignore fields they do not know,
so a newer server can add one without breaking older agents.

This module imports only pydantic and :mod:`gpuwatch.snapshot`: it is loaded by the
agent, the server and ``gpuwatch.torch`` (inside training processes), and none of them
may pull another's dependencies through it.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from typing import Annotated, Any, Literal, NamedTuple

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from gpuwatch.snapshot import (
    JSON_INTEGER,
    MAX_BYTES,
    MAX_GPUS,
    MAX_PID,
    NO_NUL,
    Epoch,
    HostSnapshot,
    ShortStr,
)

__all__ = [
    "CLOCK_SKEW_PROBLEM",
    "EVENTS_PATH",
    "INCIDENTS_OOM_PATH",
    "MAX_DEVICE_UUID_CHARS",
    "MAX_EVENT_BODY",
    "MAX_EVENT_SUMMARY_CHARS",
    "MAX_EVIDENCE_BYTES",
    "MAX_FUTURE_SKEW_SECONDS",
    "MAX_INCIDENT_BODY",
    "MAX_JSON_DEPTH",
    "MAX_OOM_MESSAGE_CHARS",
    "MAX_SNAPSHOTS_PER_REQUEST",
    "MAX_TORCH_BODY",
    "OTHER_HOST_DETAIL",
    "PARTIAL_DEFERRED",
    "PARTIAL_HEADER",
    "PUSH_INTERVAL_HEADER",
    "SNAPSHOTS_PATH",
    "TORCH_PATH",
    "IngestRequest",
    "IngestResponse",
    "ItemResult",
    "NamedDevice",
    "OomIncident",
    "ReportedEvent",
    "ReportedEventResult",
    "ReportedKind",
    "TorchReport",
    "find_device",
    "gpu_uuid_key",
    "ingest_request_json",
    "push_interval_of",
    "same_gpu_uuid",
]

# --- paths ---------------------------------------------------------------------------

SNAPSHOTS_PATH = "/api/v1/snapshots"  # on the server
EVENTS_PATH = "/api/v1/events"  # on the server
TORCH_PATH = "/torch"  # on the local agent
INCIDENTS_OOM_PATH = "/incidents/oom"  # on the local agent

# --- limits --------------------------------------------------------------------------

# A spool drain sends many per request; 500 snapshots of a large host stay well under
# the server's default 8 MiB body limit, and one transaction of that size holds
# SQLite's write lock for tens of milliseconds, not seconds.
MAX_SNAPSHOTS_PER_REQUEST = 500
# One allocator report is ~250 bytes; 16 KiB leaves room and bounds what the agent
# buffers from a local process.
MAX_TORCH_BODY = 16 * 2**10
# An incident carries the OOM message (at most MAX_OOM_MESSAGE_CHARS) and the
# diagnosis; 1 MiB holds both with room.
MAX_INCIDENT_BODY = 1 * 2**20
MAX_OOM_MESSAGE_CHARS = 65536
MAX_EVENT_SUMMARY_CHARS = 1024
# An event's evidence is stored as it comes, once per event: an OOM's carries the
# diagnosis and the host's latest snapshot (about 30 KiB for 8 GPUs and 50 processes).
# 512 KiB leaves room for a large host and bounds what one event can make the server
# store; the request around it is at most MAX_EVENT_BODY.
MAX_EVIDENCE_BYTES = 512 * 2**10
MAX_EVENT_BODY = 1 * 2**20
# Free-form JSON nests no deeper than this (a diagnosis or a snapshot nests 5 deep).
MAX_JSON_DEPTH = 32


def _plain_json(value: dict[str, Any], max_bytes: int) -> dict[str, Any]:
    """``value`` if a JSON column can store it and the read API can answer it again:
    no NaN or infinity, no NUL in a string or key, at most :data:`MAX_JSON_DEPTH` deep
    and ``max_bytes`` as compact UTF-8 JSON. Raises ValueError otherwise.

    Measured while walked, not by serialising: a serialisation of many small values
    would take several times their size in memory, in a request whose memory the
    server has budgeted from its body (server/ingest/body.py).
    """
    size = _json_size(value, 1)
    if size > max_bytes:
        raise ValueError(f"{size} bytes of JSON, more than {max_bytes}")
    return value


def _json_size(item: Any, depth: int) -> int:
    """Bytes of ``item`` as compact UTF-8 JSON; ValueError for what JSON cannot hold.
    Recursion stops at MAX_JSON_DEPTH, so it stays shallow."""
    if depth > MAX_JSON_DEPTH:
        raise ValueError(f"nested deeper than {MAX_JSON_DEPTH}")
    if isinstance(item, str):
        if "\x00" in item:
            raise ValueError("a string holds NUL")
        return len(json.dumps(item, ensure_ascii=False).encode())
    if isinstance(item, dict):
        size = 1 + max(1, len(item))  # the braces and commas; a colon per key below
        for key, inner in item.items():
            if "\x00" in key:
                raise ValueError("a key holds NUL")
            size += len(json.dumps(key, ensure_ascii=False).encode()) + 1
            size += _json_size(inner, depth + 1)
        return size
    if isinstance(item, list):
        # The brackets and commas, then the items.
        return 1 + max(1, len(item)) + sum(_json_size(inner, depth + 1) for inner in item)
    if isinstance(item, float) and not math.isfinite(item):
        raise ValueError("NaN and infinity are not JSON")
    return len(json.dumps(item))


Evidence = Annotated[
    dict[str, Any], AfterValidator(lambda value: _plain_json(value, MAX_EVIDENCE_BYTES))
]
Explanation = Annotated[
    dict[str, Any], AfterValidator(lambda value: _plain_json(value, MAX_INCIDENT_BODY))
]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


# --- agent -> server: snapshots --------------------------------------------------------


class IngestRequest(_Body):
    """One or more snapshots of the host the bearer token belongs to, oldest first."""

    snapshots: Annotated[
        list[HostSnapshot], Field(min_length=1, max_length=MAX_SNAPSHOTS_PER_REQUEST)
    ]
    spool_dropped_total: Annotated[int, Field(ge=0, le=2**62), JSON_INTEGER] | None = Field(
        default=None,
        description="Snapshots the agent has dropped, added up over its runs on this spool"
        " directory (a counter; it starts again from 0 only when the spool directory is"
        " cleared).",
    )


def ingest_request_json(snapshots: Sequence[bytes], spool_dropped_total: int) -> bytes:
    """An :class:`IngestRequest` as JSON, from snapshots that are already JSON.

    Each item of ``snapshots`` must be one ``HostSnapshot.model_dump_json()`` (what the
    agent's spool stores). The result is byte for byte what
    ``IngestRequest(snapshots=..., spool_dropped_total=...).model_dump_json()`` gives
    for those snapshots (``tests/test_wire.py`` holds it to that), without parsing
    them back into models: the reporter sends spooled bytes as they are.
    """
    return (
        b'{"snapshots":['
        + b",".join(snapshots)
        + b'],"spool_dropped_total":%d}' % spool_dropped_total
    )


# The request header by which an agent says it understands partial answers
# (``deferred`` items), and the value it sends. An agent that predates ``deferred``
# cannot validate an answer holding it, would take the whole batch as delivered and
# delete it from its spool: so the server answers partially only to a request that
# carries ``Gpuwatch-Partial: deferred``. A server that predates it ignores the header.
PARTIAL_HEADER = "Gpuwatch-Partial"
PARTIAL_DEFERRED = "deferred"

# The request header by which an agent says how often it pushes (seconds): the server
# counts the host's silence in it. A header, not a snapshot field, because the snapshot
# schema forbids unknown fields, and an agent upgraded before its server must still be
# able to push; a server that predates it ignores it. Values outside (0, 3600] are
# ignored (the server's ``agent_push_interval_seconds`` applies), as the agent's own
# setting allows no other.
PUSH_INTERVAL_HEADER = "Gpuwatch-Push-Interval"
# The 403 ``detail`` of a push whose snapshots name another host than its token's,
# followed by the token's host. The agent matches it to tell a renamed host (a new
# token or ``hostname =`` fixes it) from a refused token.
OTHER_HOST_DETAIL = "this token belongs to host "
# A snapshot collected further ahead of the server's clock than this is refused (422,
# problem type CLOCK_SKEW_PROBLEM, ``loc`` ``["body", "snapshots", i]``): it would pin
# the host's "newest applied" time. The server cannot tell an agent's clock that runs
# ahead from its own clock running behind; the agent can, roughly: if the refused
# snapshot is not that far ahead of its own clock now, it keeps it spooled and retries
# (the server's clock may be wrong), and drops it only when its own clock says it was
# stamped in the future (gpuwatch/agent/reporter.py).
MAX_FUTURE_SKEW_SECONDS = 600.0
CLOCK_SKEW_PROBLEM = "clock_skew"
MAX_PUSH_INTERVAL_SECONDS = 3600.0


def is_json_media_type(content_type: str | None) -> bool:
    """True for a ``Content-Type`` of ``application/json``, with or without parameters
    (``; charset=utf-8``): what the server's ingest and the agent's OOM reports take."""
    media_type = (content_type or "").split(";", 1)[0].strip().lower()
    return media_type == "application/json"


def push_interval_of(value: str | None) -> float | None:
    """The push interval a :data:`PUSH_INTERVAL_HEADER` value states, or None when it is
    absent or not a number of seconds in (0, 3600]."""
    if value is None:
        return None
    try:
        seconds = float(value.strip())
    except ValueError:
        return None
    return seconds if 0 < seconds <= MAX_PUSH_INTERVAL_SECONDS else None


ItemResult = Literal["accepted", "duplicate", "late", "deferred"]


class IngestResponse(BaseModel):
    """What happened to each snapshot: ``results[i]`` is about ``snapshots[i]``.

    ``accepted``: stored and applied to the host's state. ``late``: stored (its key is
    recorded, so a retry is a duplicate) but not applied, because the host's state is
    already newer than it (a late spool drain); history does not move backwards.
    ``duplicate``: this host stored that ``(agent_id, boot_id, sequence)`` before (a
    retry). All three are delivered. ``deferred``: not stored; send it again. The
    server ran out of its time budget for the request after storing the others, which
    it committed as if they had been sent alone; it defers only when the request
    carried :data:`PARTIAL_HEADER`. The ``accepted`` count covers ``accepted`` and
    ``late`` items: the snapshots this request stored.
    """

    accepted: int
    duplicate: int
    results: list[ItemResult]


# --- agent -> server: events it observed ---------------------------------------------

ReportedKind = Literal["reaped", "oom"]


class ReportedEvent(_Body):
    """An event an agent observed itself: a process the reaper killed, or an OOM."""

    kind: ReportedKind
    hostname: ShortStr
    gpu_index: Annotated[int, Field(ge=0, lt=MAX_GPUS), JSON_INTEGER] | None = None
    pid: Annotated[int, Field(ge=0, le=MAX_PID), JSON_INTEGER] | None = None
    user: ShortStr | None = None
    held_bytes: Annotated[int, Field(ge=0, le=MAX_BYTES), JSON_INTEGER] | None = None
    summary: str = Field(max_length=MAX_EVENT_SUMMARY_CHARS, pattern=NO_NUL)
    evidence: Evidence = Field(
        default_factory=dict,
        description=f"Free-form JSON: at most {MAX_EVIDENCE_BYTES} bytes compact and "
        f"{MAX_JSON_DEPTH} levels deep; no NaN, infinity or NUL.",
    )
    occurred_at: Epoch


class ReportedEventResult(BaseModel):
    """``duplicate`` is true when the same event was already recorded (a retried POST)."""

    id: int | None
    duplicate: bool


# --- gpuwatch.torch -> local agent ---------------------------------------------------------

# A GPU's UUID as CUDA or NVML prints it ("GPU-8932f937-...", MIG's "MIG-..."; PyTorch's
# str() omits the prefix; CUDA_VISIBLE_DEVICES may hold a unique prefix, or CUDA 11's
# "MIG-GPU-<uuid>/<gi>/<ci>": find_device). Printable ASCII without spaces: no control character, and
# never longer than NVML's own UUID buffer (96 bytes, NVML_DEVICE_UUID_V2_BUFFER_SIZE).
MAX_DEVICE_UUID_CHARS = 96
DeviceUuid = Annotated[
    str, Field(min_length=1, max_length=MAX_DEVICE_UUID_CHARS, pattern=r"^[!-~]+$")
]


def gpu_uuid_key(uuid: str) -> str:
    """``uuid`` in the form two names of one device share: lowercase, without its
    ``GPU-`` or ``MIG-`` prefix. PyTorch's ``get_device_properties().uuid`` prints a
    GPU's or a MIG instance's UUID without any prefix; NVML with ``GPU-`` or ``MIG-``
    (an older ``gpuwatch.torch`` sent a bare MIG UUID as ``GPU-...``). The UUID itself
    is unique either way: the prefix only says what kind of device it names."""
    lowered = uuid.strip().lower()
    for prefix in ("gpu-", "mig-"):
        if lowered.startswith(prefix):
            return lowered[len(prefix) :]
    return lowered


def same_gpu_uuid(a: str, b: str) -> bool:
    """True when ``a`` and ``b`` name the same device (see :func:`gpu_uuid_key`)."""
    key = gpu_uuid_key(a)
    return bool(key) and key == gpu_uuid_key(b)


class NamedDevice(NamedTuple):
    """A GPU or a MIG instance as NVML names it, for :func:`find_device`.

    ``parent_uuid`` and ``gpu_instance_id`` are set for a MIG instance: its GPU's UUID
    and NVML's GPU instance id (``None`` where NVML did not say).
    """

    uuid: str
    parent_uuid: str | None = None
    gpu_instance_id: int | None = None


# CUDA 11.0-11.x's MIG device name: "MIG-GPU-<parent uuid>/<gpu instance>/<compute instance>".
_LEGACY_MIG = re.compile(r"^mig-(gpu-[0-9a-f-]+)/([0-9]+)/([0-9]+)$")


def find_device(reported: str, devices: Sequence[NamedDevice]) -> NamedDevice | None:
    """The one device in ``devices`` (all of a host's GPUs and MIG instances) that the
    UUID ``reported`` by a process names, or ``None``.

    * The same UUID, compared without ``GPU-``/``MIG-`` and case (:func:`gpu_uuid_key`).
    * The old MIG form ``MIG-GPU-<parent>/<gi>/<ci>``: the MIG instance of the GPU with
      that UUID whose GPU instance id is ``gi``, when exactly one is. The agent does not
      read compute instance ids, so ``ci`` is not checked: a GPU instance split into
      several compute instances matches none of them.
    * A unique prefix, as ``CUDA_VISIBLE_DEVICES`` accepts (``GPU-8932f937``), compared
      without ``GPU-``/``MIG-``: the device whose UUID begins with it, when exactly one
      of ``devices`` does. A prefix two devices share names neither.
    """
    lowered = reported.strip().lower()
    legacy = _LEGACY_MIG.fullmatch(lowered)
    if legacy is not None:
        parent, gi = gpu_uuid_key(legacy.group(1)), int(legacy.group(2))
        hits = [
            d
            for d in devices
            if d.parent_uuid is not None
            and gpu_uuid_key(d.parent_uuid) == parent
            and d.gpu_instance_id == gi
        ]
        return hits[0] if len(hits) == 1 else None
    key = gpu_uuid_key(lowered)
    if not key:
        return None
    exact = [d for d in devices if gpu_uuid_key(d.uuid) == key]
    if exact:
        return exact[0] if len(exact) == 1 else None
    begins = [d for d in devices if gpu_uuid_key(d.uuid).startswith(key)]
    return begins[0] if len(begins) == 1 else None


class TorchReport(_Body):
    """PyTorch's allocator on one device of one process (``torch.cuda.memory_stats``).

    ``device_uuid``, when given, names the GPU and wins over ``device_index``: PyTorch's
    device ordinal is not NVML's index (``CUDA_VISIBLE_DEVICES``, CUDA's fastest-first
    order). ``device_index`` stays for senders that cannot tell the UUID (older ones):
    the reporter's best guess at NVML's index.
    """

    pid: Annotated[int, Field(ge=1, le=MAX_PID), JSON_INTEGER]
    device_index: Annotated[int, Field(ge=0, lt=MAX_GPUS), JSON_INTEGER]
    device_uuid: DeviceUuid | None = None
    allocated_bytes: Annotated[int, Field(ge=0, le=MAX_BYTES), JSON_INTEGER]
    reserved_bytes: Annotated[int, Field(ge=0, le=MAX_BYTES), JSON_INTEGER]
    reserved_unallocated_bytes: Annotated[int, Field(ge=0, le=MAX_BYTES), JSON_INTEGER]
    # PyTorch's max_memory_allocated: since the process started or its own last reset
    # (since the previous report only where the reporter was told to reset it).
    peak_allocated_bytes: Annotated[int, Field(ge=0, le=MAX_BYTES), JSON_INTEGER]
    reported_at: Epoch


class OomIncident(_Body):
    """An out-of-memory error raised in a training process, with its diagnosis.

    ``explanation`` is ``gpuwatch.doctor.explain.Explanation`` as JSON (kept a plain
    object here, so this module needs nothing from the doctor). ``occurred_at`` is
    ``None`` when the sender's clock is unknown; the agent then uses its own. It is
    the sender's word, kept on the incident; the agent's reaper policy goes by when the
    agent received it. ``device_uuid`` and ``device_index`` as in :class:`TorchReport`;
    neither is set for an OOM on no GPU the agent can see (host memory, MPS, XPU).
    """

    pid: Annotated[int, Field(ge=1, le=MAX_PID), JSON_INTEGER]
    device_index: Annotated[int, Field(ge=0, lt=MAX_GPUS), JSON_INTEGER] | None = None
    device_uuid: DeviceUuid | None = None
    message: str = Field(max_length=MAX_OOM_MESSAGE_CHARS, pattern=NO_NUL)
    explanation: Explanation | None = None
    occurred_at: Epoch | None = None
