"""Builders of realistic snapshots for server tests (defaults: one A100-80GB host)."""

from __future__ import annotations

from typing import Any

from gpuwatch.snapshot import Gpu, GpuProcess, HostSnapshot, ProcessOwner

GIB = 2**30
T0 = 1_800_000_000.0  # a fixed epoch, so tests never depend on the wall clock


def process(
    pid: int,
    *,
    used_gib: float = 4,
    sm: float | None = 0.5,
    user: str = "alice",
    start_time: float | None = None,
    **fields: Any,
) -> GpuProcess:
    return GpuProcess(
        pid=pid,
        used_bytes=int(used_gib * GIB),
        sm_ratio=sm,
        name="python",
        command=f"python train.py --run {pid}",
        start_time=T0 - 1000 - pid if start_time is None else start_time,
        ppid=1000,
        owner=ProcessOwner(user=user, uid=1000),
        **fields,
    )


def gpu(index: int, processes: list[GpuProcess] | None = None, **fields: Any) -> Gpu:
    procs = processes or []
    total = 80 * GIB
    used = sum(p.used_bytes or 0 for p in procs) + fields.pop("extra_bytes", 0)
    values: dict[str, Any] = {
        "index": index,
        "uuid": f"GPU-{index:08d}-0000-0000-0000-000000000000",
        "name": "NVIDIA A100-SXM4-80GB",
        "memory_total_bytes": total,
        "memory_used_bytes": used,
        "memory_free_bytes": total - used,
        "unattributed_bytes": used - sum(p.used_bytes or 0 for p in procs),
        "utilization_ratio": 0.5,
        "processes": procs,
    }
    values.update(fields)
    return Gpu(**values)


def snapshot(
    sequence: int,
    gpus: list[Gpu],
    *,
    hostname: str = "host-1",
    at: float | None = None,
    boot_id: str = "boot-1",
    interval: float = 15.0,
) -> HostSnapshot:
    return HostSnapshot(
        agent_id=f"agent-{hostname}",
        hostname=hostname,
        boot_id=boot_id,
        sequence=sequence,
        collected_at=T0 + sequence * interval if at is None else at,
        driver_version="550.54.15",
        gpus=gpus,
    )


def big_host(
    sequence: int, *, hostname: str = "host-1", gpus: int = 8, procs: int = 50
) -> HostSnapshot:
    """8 GPUs and 50 processes spread over them: the benchmark shape."""
    per_gpu: list[list[GpuProcess]] = [[] for _ in range(gpus)]
    for i in range(procs):
        per_gpu[i % gpus].append(process(10_000 + i, used_gib=1 + i % 5, sm=(i % 3) / 4))
    return snapshot(sequence, [gpu(i, per_gpu[i]) for i in range(gpus)], hostname=hostname)


def body(*snapshots: HostSnapshot, **extra: Any) -> dict[str, Any]:
    return {"snapshots": [s.model_dump(mode="json") for s in snapshots], **extra}
