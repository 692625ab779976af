"""API shapes of hosts and GPUs. Sizes bytes, times Unix epoch seconds, ratios 0..1."""

from __future__ import annotations

from pydantic import BaseModel, Field

from gpuwatch.server.processes.schemas import ProcessOut


class HostOut(BaseModel):
    """One host and how recently its agent reported."""

    hostname: str
    agent_id: str | None
    boot_id: str | None
    driver_version: str | None
    cuda_driver_version: str | None
    fake: bool
    gpu_count: int
    last_seen_at: float | None = Field(description="collected_at of its newest snapshot.")
    last_received_at: float | None = Field(description="Server time its last snapshot arrived.")
    silent: bool = Field(description="No snapshot for agent_silent_intervals push intervals.")
    spool_dropped_total: int = Field(description="Snapshots its agent's spool had to drop.")
    retired_at: float | None = Field(
        None, description="When it was retired (gpuwatch token revoke --retire); null if not."
    )


class GpuOut(BaseModel):
    """One GPU's last reported state and the processes holding memory on it now."""

    index: int
    uuid: str
    name: str | None
    lost: bool
    read_error: str | None
    memory_total_bytes: int | None
    memory_used_bytes: int | None
    memory_free_bytes: int | None
    unattributed_bytes: int | None
    utilization_ratio: float | None
    last_seen_at: float
    processes: list[ProcessOut] = Field(
        description="Its open processes, the largest holders first: at most"
        " MAX_PROCESSES_SHOWN (100); the rest are counted in processes_total and listed by"
        " GET /api/v1/processes?host=...&gpu=...&open=true."
    )
    processes_total: int = Field(description="How many open processes it has in all.")
    processes_truncated: bool = Field(
        description="True when processes lists fewer than processes_total."
    )


class HostDetail(HostOut):
    """A host with its GPUs and their current processes."""

    gpus: list[GpuOut]
