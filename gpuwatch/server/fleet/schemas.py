"""API shape of the fleet summary. Sizes bytes, times Unix epoch seconds."""

from __future__ import annotations

from pydantic import BaseModel, Field

from gpuwatch.server.events.schemas import EventOut

# Upper bounds (exclusive, as a ratio of total memory) of the fullness buckets.
FULLNESS_BUCKETS = (("0-25%", 0.25), ("25-50%", 0.5), ("50-75%", 0.75), ("75-90%", 0.9))
FULL_BUCKET = "90-100%"
UNKNOWN_BUCKET = "unknown"


class FleetOut(BaseModel):
    """The fleet at a glance."""

    generated_at: float
    hosts: int
    gpus: int
    gpus_by_fullness: dict[str, int] = Field(
        description="GPUs per used/total bucket; 'unknown' holds lost GPUs, GPUs with no "
        "memory reading and GPUs of silent hosts (their numbers are stale)."
    )
    orphaned_bytes: int = Field(description="Memory held by open orphaned events.")
    idle_bytes: int = Field(description="Memory held by open idle events.")
    top_idle: list[EventOut] = Field(description="Largest open idle holders.")
    silent_hosts: list[str]
