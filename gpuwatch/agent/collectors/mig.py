"""Per-MIG-instance memory, rendered by :class:`~gpuwatch.agent.collectors.gpu.GpuCollector`.

A job in a MIG instance runs out of memory at its instance's size, whatever the rest of
the GPU holds, so the GPU's own figures cannot say that an instance is filling up.
Labels ``gpu`` and ``uuid`` name the physical GPU, as on every GPU series;
``gpu_instance_id`` is NVML's GPU instance id (dcgm-exporter's ``GPU_I_ID``, and the
``gpu_instance_id`` of the profiling and per-process series) and ``profile`` its
profile, e.g. ``3g.40gb`` (empty when NVML's name for it has none). An instance whose
id NVML did not give has no series (it could not be told from the others).
"""

from __future__ import annotations

from gpuwatch.metricspec import Families, MetricSpec
from gpuwatch.snapshot import Gpu

_L = ("gpu", "uuid", "gpu_instance_id", "profile")
_MIG = "GPUs in MIG mode, one series per instance"

MEMORY_TOTAL = MetricSpec(
    "gpuwatch_mig_memory_total_bytes",
    "gauge",
    "Framebuffer memory of the MIG instance: what its jobs can allocate in all.",
    _L,
    _MIG,
)
MEMORY_USED = MetricSpec(
    "gpuwatch_mig_memory_used_bytes",
    "gauge",
    "Framebuffer memory in use in the MIG instance.",
    _L,
    _MIG,
)

METRICS = (MEMORY_TOTAL, MEMORY_USED)


def add_mig_memory(f: Families, gpu: Gpu) -> None:
    """Add the memory series of each of the GPU's MIG instances that has an id."""
    for mig in gpu.mig_instances:
        if mig.gpu_instance_id is None:
            continue
        labels = (str(gpu.index), gpu.uuid, str(mig.gpu_instance_id), mig.profile or "")
        f.add(MEMORY_TOTAL, labels, mig.memory_total_bytes)
        f.add(MEMORY_USED, labels, mig.memory_used_bytes)
