"""API shapes of events. Sizes bytes, times Unix epoch seconds."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

# The bodies an agent posts (reaped, oom) are part of the wire contract: gpuwatch/wire.py.
EventKind = Literal[
    "orphaned",
    "runaway",
    "idle",
    "filling_up",
    "gpu_lost",
    "gpu_back",
    "agent_silent",
    "reaped",
    "oom",
]


class EventOut(BaseModel):
    """One event. Open (``ended_at`` null) while its condition still holds."""

    id: int
    kind: EventKind
    reason: str = Field(description="Which rule fired, e.g. dead_pid, leak, share, idle.")
    hostname: str
    gpu_index: int | None
    gpu_uuid: str | None
    pid: int | None
    user: str | None
    held_bytes: int | None
    summary: str
    evidence: dict[str, Any]
    started_at: float
    last_seen_at: float
    ended_at: float | None
    open: bool


class EventPage(BaseModel):
    """A page of events, newest ``started_at`` first; pass ``next_cursor`` back for more."""

    items: list[EventOut]
    next_cursor: str | None


class IdleHolderOut(BaseModel):
    """How much idle holding one user accounts for in a time range."""

    user: str | None
    events: int
    held_byte_seconds: float = Field(description="Sum of held bytes x seconds flagged idle.")
    max_held_bytes: int | None
