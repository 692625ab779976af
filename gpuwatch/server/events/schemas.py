"""API shapes of events. Sizes bytes, times Unix epoch seconds."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from gpuwatch.snapshot import MAX_BYTES, MAX_PID, Epoch, ShortStr

EventKind = Literal[
    "orphaned", "runaway", "idle", "gpu_lost", "gpu_back", "agent_silent", "reaped", "oom"
]
ReportedKind = Literal["reaped", "oom"]


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


class ReportedEvent(BaseModel):
    """An event an agent observed itself: a process the reaper killed, or an OOM."""

    model_config = ConfigDict(extra="forbid")

    kind: ReportedKind
    hostname: ShortStr
    gpu_index: int | None = Field(None, ge=0, lt=64)
    pid: int | None = Field(None, ge=0, le=MAX_PID)
    user: ShortStr | None = None
    held_bytes: int | None = Field(None, ge=0, le=MAX_BYTES)
    summary: str = Field(max_length=1024)
    evidence: dict[str, Any] = Field(default_factory=dict)
    occurred_at: Epoch


class ReportedEventResult(BaseModel):
    """``duplicate`` is true when the same event was already recorded (a retried POST)."""

    id: int | None
    duplicate: bool


class IdleHolderOut(BaseModel):
    """How much idle holding one user accounts for in a time range."""

    user: str | None
    events: int
    held_byte_seconds: float = Field(description="Sum of held bytes x seconds flagged idle.")
    max_held_bytes: int | None
