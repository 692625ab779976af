"""Hand-built snapshots for exporter and rendering tests (deterministic, no NVML)."""

from __future__ import annotations

from gpuwatch.snapshot import Gpu, GpuProcess, HostSnapshot, ProcessOwner, TorchAllocatorStats

GiB = 2**30
MiB = 2**20


def sample_snapshot() -> HostSnapshot:
    notebook = GpuProcess(
        pid=4242,
        used_bytes=20 * GiB,
        sm_ratio=0.0,
        name="python",
        command="python -m ipykernel_launcher -f /run/user/1000/jupyter/kernel-1.json",
        start_time=1_700_000_000.0,
        ppid=1,
        orphaned=False,
        jupyter_kernel=True,
        jupyter_server_alive=False,
        owner=ProcessOwner(user="alice", uid=1000),
    )
    trainer = GpuProcess(
        pid=5151,
        used_bytes=30 * GiB,
        sm_ratio=0.97,
        name="python",
        command="python train.py --bs 32",
        start_time=1_700_003_600.0,
        ppid=5000,
        owner=ProcessOwner(
            user="bob",
            uid=1001,
            container_runtime="docker",
            container_id="a" * 64,
            slurm_job_id="4242",
        ),
        torch=TorchAllocatorStats(
            allocated_bytes=24 * GiB,
            reserved_bytes=29 * GiB,
            reserved_unallocated_bytes=5 * GiB,
            peak_allocated_bytes=26 * GiB,
            reported_at=1_700_010_000.0,
        ),
    )
    ghost = GpuProcess(pid=999_999, used_bytes=2 * GiB, alive=False, owner=ProcessOwner())
    return HostSnapshot(
        agent_id="agent-1",
        hostname="gpu-box",
        boot_id="boot-1",
        sequence=7,
        collected_at=1_700_010_000.0,
        poll_duration_seconds=0.012,
        driver_version="550.54.15",
        nvml_version="12.550.54.15",
        cuda_driver_version="12.4",
        gpus=[
            Gpu(
                index=0,
                uuid="GPU-00000000-0000-0000-0000-000000000000",
                name="NVIDIA A100-SXM4-80GB",
                pci_bus_id="00000000:07:00.0",
                memory_total_bytes=80 * GiB,
                memory_used_bytes=53 * GiB,
                memory_free_bytes=26 * GiB,
                memory_reserved_bytes=1 * GiB,
                utilization_ratio=0.97,
                memory_busy_ratio=0.41,
                temperature_celsius=64.0,
                power_watts=312.5,
                power_limit_watts=400.0,
                unattributed_bytes=1 * GiB,
                processes=[notebook, trainer, ghost],
            ),
            Gpu(
                index=1,
                uuid="GPU-11111111-1111-1111-1111-111111111111",
                name="NVIDIA A100-SXM4-80GB",
                lost=True,
            ),
        ],
    )
