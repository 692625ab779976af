"""The ingest request and response bodies."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from gpuwatch.snapshot import HostSnapshot

# A spool drain sends many per request; 500 snapshots of a large host stay well under
# the default 8 MiB body limit, and one transaction of that size holds SQLite's write
# lock for tens of milliseconds, not seconds.
MAX_SNAPSHOTS_PER_REQUEST = 500


class IngestRequest(BaseModel):
    """One or more snapshots of the host the bearer token belongs to, oldest first."""

    model_config = ConfigDict(extra="forbid")

    snapshots: Annotated[
        list[HostSnapshot], Field(min_length=1, max_length=MAX_SNAPSHOTS_PER_REQUEST)
    ]
    spool_dropped_total: int | None = Field(
        None,
        ge=0,
        le=2**62,
        description="Snapshots the agent's spool has dropped since the agent started (a counter).",
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
