"""Per-GPU and per-MIG-instance profiling metrics, from GPU Performance Monitoring (GPM).

Rendered by :class:`~gpuwatch.agent.collectors.gpu.GpuCollector`; declared here. GPM
(Hopper and later) reads hardware counters: how busy the engines, SMs, tensor and FP
pipes, DRAM and PCIe were between the agent's last two polls, what DCGM's profiler
reports as ``DCGM_FI_PROF_*``. Labels ``gpu`` and ``uuid`` name the physical GPU;
``gpu_instance_id`` is NVML's MIG GPU instance id, or empty for the whole GPU. Absent
where GPM is not there (before Hopper, older drivers), on the agent's first poll, and
for each figure the driver does not answer: never 0 for "not known".
"""

from __future__ import annotations

from gpuwatch.metricspec import Families, MetricSpec
from gpuwatch.snapshot import Gpu, Profiling

_L = ("gpu", "uuid", "gpu_instance_id")
_GPM = "GPM: Hopper and later, from the agent's second poll"

ACTIVITY = MetricSpec(
    "gpuwatch_gpu_activity_ratio", "gauge",
    "Share of the time since the previous poll each unit was active (0-1), by activity: "
    "graphics (an engine busy), sm (SMs with a warp), sm_occupancy (resident warps of the "
    "maximum), tensor (any tensor pipe), tensor_dfma, tensor_hmma, tensor_imma, dram (of "
    "peak bandwidth), fp64, fp32, fp16 (non-tensor pipes).",
    (*_L, "activity"), _GPM,
)  # fmt: skip
PCIE = MetricSpec(
    "gpuwatch_gpu_pcie_bytes_per_second", "gauge",
    "PCIe traffic since the previous poll, headers and payload, by direction as the GPU "
    "sees it (tx: sent, rx: received).",
    (*_L, "direction"), _GPM,
)  # fmt: skip

METRICS = (ACTIVITY, PCIE)

# activity label -> Profiling field
_ACTIVITIES = (
    ("graphics", "graphics_ratio"), ("sm", "sm_active_ratio"),
    ("sm_occupancy", "sm_occupancy_ratio"), ("tensor", "tensor_ratio"),
    ("tensor_dfma", "tensor_dfma_ratio"), ("tensor_hmma", "tensor_hmma_ratio"),
    ("tensor_imma", "tensor_imma_ratio"), ("dram", "dram_ratio"), ("fp64", "fp64_ratio"),
    ("fp32", "fp32_ratio"), ("fp16", "fp16_ratio"),
)  # fmt: skip


def add_profiling(f: Families, gpu: Gpu) -> None:
    """Add the GPU's GPM series and each of its MIG instances'."""
    base = (str(gpu.index), gpu.uuid)
    _add(f, (*base, ""), gpu.profiling)
    for mig in gpu.mig_instances:
        if mig.gpu_instance_id is not None:
            _add(f, (*base, str(mig.gpu_instance_id)), mig.profiling)


def _add(f: Families, labels: tuple[str, str, str], profiling: Profiling | None) -> None:
    if profiling is None:
        return
    for activity, name in _ACTIVITIES:
        f.add(ACTIVITY, (*labels, activity), getattr(profiling, name))
    f.add(PCIE, (*labels, "tx"), profiling.pcie_tx_bytes_per_second)
    f.add(PCIE, (*labels, "rx"), profiling.pcie_rx_bytes_per_second)
