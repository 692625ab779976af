"""API shapes of process lifetimes. Sizes bytes, times Unix epoch seconds, ratios 0..1."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class ProcessOut(BaseModel):
    """One process's tenure on one GPU."""

    model_config = ConfigDict(from_attributes=True)

    id: int
    hostname: str
    gpu_index: int
    gpu_uuid: str
    pid: int
    start_time: float | None = Field(description="Process start time; null when not visible.")
    kind: str
    name: str | None
    command: str | None
    user: str | None
    uid: int | None
    container_id: str | None
    pod_uid: str | None
    slurm_job_id: str | None
    orphaned: bool = Field(
        description="Its owner is gone: the agent saw it lose its parent, or it has an open"
        " orphaned event (a dead PID still holding memory included)."
    )
    orphan_reason: str | None = Field(
        None,
        description="The reason of its open orphaned event (dead_pid, reparented, job_ended,"
        " jupyter_server_gone); null when it has none.",
    )
    first_seen_at: float
    last_seen_at: float
    ended_at: float | None = Field(description="Null while the process still holds the GPU.")
    current_bytes: int | None
    peak_bytes: int | None
    sm_ratio: float | None
    idle_since: float | None = Field(
        description="Start of its current run of zero SM activity; null when it is active,"
        " its activity is unknown, or it has an open orphaned event (orphaned, not idle)."
    )
    idle_seconds: float | None = Field(description="last_seen_at - idle_since.")


class ProcessPage(BaseModel):
    """A page of lifetimes, newest first; pass ``next_cursor`` back for the next page."""

    items: list[ProcessOut]
    next_cursor: str | None


class ProcessSampleOut(BaseModel):
    """One closed downsampling bucket of a lifetime (``process_samples``)."""

    model_config = ConfigDict(from_attributes=True)

    t: float = Field(description="Bucket start; the bucket spans sample_interval_seconds.")
    used_bytes: int | None = Field(description="Lowest memory held in the bucket (its floor).")
    peak_bytes: int | None = Field(description="Highest memory held in the bucket.")
    sm_ratio: float | None = Field(
        description="Busiest SM activity in the bucket; 0 only if every poll saw 0, null when "
        "a poll could not tell."
    )


class ProcessSamples(BaseModel):
    """A lifetime and its coarse samples, oldest first."""

    lifetime: ProcessOut
    sample_interval_seconds: float = Field(description="The server's bucket length.")
    samples: list[ProcessSampleOut]
    truncated: bool = Field(
        description="True when older samples in the range were left out (past limit)."
    )
