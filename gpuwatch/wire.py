"""The wire contract: every body that crosses a process boundary, its path and its limits.

Both ends of each link import their models from here, so a field cannot be renamed on
one side only. The snapshot itself is :class:`~gpuwatch.snapshot.HostSnapshot`; this
module holds the envelopes around it and the other bodies:

* agent -> server, ``POST /api/v1/snapshots``: :class:`IngestRequest`, answered with
  :class:`IngestResponse`;
* agent -> server, ``POST /api/v1/events`` (an OOM it relays, a process its reaper
  killed): :class:`ReportedEvent`, answered with :class:`ReportedEventResult`;
* ``gpuwatch.torch`` -> the local agent, ``POST /torch``: :class:`TorchReport`;
* ``gpuwatch.torch`` -> the local agent, ``POST /incidents/oom``: :class:`OomIncident`.

Sizes are bytes, times Unix epoch seconds. Bodies are strict (``extra="forbid"``) and
bounded, because each side takes them from another process. The answers
(:class:`IngestResponse`, :class:`ReportedEventResult`) ignore fields they do not know,
so a newer server can add one without breaking older agents.

This module imports only pydantic and :mod:`gpuwatch.snapshot`: it is loaded by the
agent, the server and ``gpuwatch.torch`` (inside training processes), and none of them
may pull another's dependencies through it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from gpuwatch.snapshot import MAX_BYTES, MAX_GPUS, MAX_PID, Epoch, HostSnapshot, ShortStr

__all__ = [
    "EVENTS_PATH",
    "INCIDENTS_OOM_PATH",
    "MAX_EVENT_SUMMARY_CHARS",
    "MAX_INCIDENT_BODY",
    "MAX_OOM_MESSAGE_CHARS",
    "MAX_SNAPSHOTS_PER_REQUEST",
    "MAX_TORCH_BODY",
    "SNAPSHOTS_PATH",
    "TORCH_PATH",
    "IngestRequest",
    "IngestResponse",
    "ItemResult",
    "OomIncident",
    "ReportedEvent",
    "ReportedEventResult",
    "ReportedKind",
    "TorchReport",
    "ingest_request_json",
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


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


# --- agent -> server: snapshots --------------------------------------------------------


class IngestRequest(_Body):
    """One or more snapshots of the host the bearer token belongs to, oldest first."""

    snapshots: Annotated[
        list[HostSnapshot], Field(min_length=1, max_length=MAX_SNAPSHOTS_PER_REQUEST)
    ]
    spool_dropped_total: int | None = Field(
        default=None,
        ge=0,
        le=2**62,
        description="Snapshots the agent's spool has dropped since the agent started (a counter).",
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


ItemResult = Literal["accepted", "duplicate"]


class IngestResponse(BaseModel):
    """What happened to each snapshot: ``results[i]`` is about ``snapshots[i]``.

    ``duplicate`` means the ``(agent_id, boot_id, sequence)`` was stored before (a
    retry); the agent treats both as delivered.
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
    gpu_index: int | None = Field(default=None, ge=0, lt=MAX_GPUS)
    pid: int | None = Field(default=None, ge=0, le=MAX_PID)
    user: ShortStr | None = None
    held_bytes: int | None = Field(default=None, ge=0, le=MAX_BYTES)
    summary: str = Field(max_length=MAX_EVENT_SUMMARY_CHARS)
    evidence: dict[str, Any] = Field(default_factory=dict)
    occurred_at: Epoch


class ReportedEventResult(BaseModel):
    """``duplicate`` is true when the same event was already recorded (a retried POST)."""

    id: int | None
    duplicate: bool


# --- gpuwatch.torch -> local agent ---------------------------------------------------------


class TorchReport(_Body):
    """PyTorch's allocator on one device of one process (``torch.cuda.memory_stats``)."""

    pid: int = Field(ge=1, le=MAX_PID)
    device_index: int = Field(ge=0, lt=MAX_GPUS)
    allocated_bytes: int = Field(ge=0, le=MAX_BYTES)
    reserved_bytes: int = Field(ge=0, le=MAX_BYTES)
    reserved_unallocated_bytes: int = Field(ge=0, le=MAX_BYTES)
    # The peak since the previous report (the reporter resets PyTorch's counter).
    peak_allocated_bytes: int = Field(ge=0, le=MAX_BYTES)
    reported_at: Epoch


class OomIncident(_Body):
    """An out-of-memory error raised in a training process, with its diagnosis.

    ``explanation`` is ``gpuwatch.doctor.explain.Explanation`` as JSON (kept a plain
    object here, so this module needs nothing from the doctor). ``occurred_at`` is
    ``None`` when the sender's clock is unknown; the agent then uses its own.
    """

    pid: int = Field(ge=1, le=MAX_PID)
    device_index: int | None = Field(default=None, ge=0, lt=MAX_GPUS)
    message: str = Field(max_length=MAX_OOM_MESSAGE_CHARS)
    explanation: dict[str, Any] | None = None
    occurred_at: Epoch | None = None
