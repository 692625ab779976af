"""Hand-built snapshots for exporter and rendering tests (deterministic, no NVML)."""

from __future__ import annotations

from gpuwatch.snapshot import (
    Gpu,
    GpuProcess,
    HostSnapshot,
    ProcessOwner,
    Profiling,
    TorchAllocatorStats,
)

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
                # Health: every field set, so every declared family is exercised (a real
                # board reports either retired pages or remapped rows, not both).
                memory_temperature_celsius=71.0,
                energy_joules=123_456_789.5,
                clock_sm_hertz=1.41e9,
                clock_memory_hertz=1.593e9,
                fan_ratio=0.45,
                encoder_ratio=0.0,
                decoder_ratio=0.02,
                throttle_reasons=["sw_power_cap"],
                ecc_uncorrected_volatile=0,
                ecc_uncorrected_aggregate=1,
                ecc_corrected_volatile=3,
                ecc_corrected_aggregate=17,
                retired_pages_single_bit=0,
                retired_pages_double_bit=0,
                retired_pages_pending=False,
                remapped_rows_correctable=2,
                remapped_rows_uncorrectable=0,
                remapped_rows_pending=False,
                remapped_rows_failure=False,
                xid_errors=1,
                xid_last_code=13,
                pcie_replay_errors=0,
                # GPM figures (Hopper and later; set on this sample board for the exposition).
                profiling=Profiling(
                    graphics_ratio=0.62,
                    sm_active_ratio=0.55,
                    sm_occupancy_ratio=0.31,
                    tensor_ratio=0.4,
                    tensor_dfma_ratio=0.0,
                    tensor_hmma_ratio=0.4,
                    tensor_imma_ratio=0.0,
                    dram_ratio=0.27,
                    fp64_ratio=0.0,
                    fp32_ratio=0.12,
                    fp16_ratio=0.05,
                    pcie_tx_bytes_per_second=52428800.0,
                    pcie_rx_bytes_per_second=1048576.0,
                ),
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
