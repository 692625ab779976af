"""Per-process metrics: who holds how much on which GPU (opt-in; capped).

Per-process series are unbounded in principle (PIDs churn), so they are off by default
(``--collector.processes`` / ``GPUWATCH_AGENT_PROCESS_METRICS``) and capped: each scrape
keeps the ``max_series`` largest holders and reports how many were left out. Labels are
kept cardinality-safe: the process *name* (not its command line), a 12-character
container id, the pod UID and the Slurm job id. The full history of every PID belongs in
the central server, not in Prometheus.

Processes that run ``gpuwatch.torch`` opted in themselves, so their allocator figures
are exported even when per-process metrics are off (still within the cap).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client.metrics_core import Metric

from gpuwatch.metricspec import Families, MetricSpec
from gpuwatch.snapshot import Gpu, GpuProcess, HostSnapshot

# `slurm_job`, not `job`: Prometheus reserves `job` for the scrape target.
# `gpu_instance_id`: the MIG instance the process runs in, as on the MIG and profiling
# series (empty off MIG), so a MIG instance's holders can be told from its neighbours'.
_L = ("gpu", "uuid", "gpu_instance_id", "pid", "user", "name", "container", "pod", "slurm_job")
_OPT_IN = "opt-in: process_metrics"
_TORCH = "processes running gpuwatch.torch"

MEMORY = MetricSpec(
    "gpuwatch_gpu_process_memory_used_bytes",
    "gauge",
    "GPU memory used by the process.",
    _L,
    _OPT_IN,
)
SM = MetricSpec(
    "gpuwatch_gpu_process_sm_ratio",
    "gauge",
    "SM busy ratio of the process since the previous poll (0-1); absent on a GPU in MIG mode, where NVML has no per-process utilization.",
    _L,
    _OPT_IN + "; not in MIG mode",
)
START = MetricSpec(
    "gpuwatch_gpu_process_start_time_seconds",
    "gauge",
    "Process start time, Unix epoch (tells reused PIDs apart).",
    _L,
    _OPT_IN,
)
# Which holders the GPU's dead and orphaned sums count, so a dashboard can leave them
# out of the idle holders (the server ranks orphaned above idle: each byte once).
ORPHANED = MetricSpec(
    "gpuwatch_gpu_process_orphaned",
    "gauge",
    "1 if the process's owner is gone: its PID no longer exists (a context left behind), its parent died (reparented), or it is a Jupyter kernel whose server is gone; else 0.",
    _L,
    _OPT_IN + "; absent while the agent cannot see the process",
)
TORCH_ALLOCATED = MetricSpec(
    "gpuwatch_gpu_process_torch_allocated_bytes",
    "gauge",
    "Memory allocated to tensors, as PyTorch's allocator reports it.",
    _L,
    _TORCH,
)
TORCH_RESERVED = MetricSpec(
    "gpuwatch_gpu_process_torch_reserved_bytes",
    "gauge",
    "Memory PyTorch's caching allocator holds from the driver.",
    _L,
    _TORCH,
)
TORCH_FREE_CACHED = MetricSpec(
    "gpuwatch_gpu_process_torch_reserved_unallocated_bytes", "gauge",
    "Reserved by PyTorch but not allocated to tensors (fragmentation / cache).", _L, _TORCH,
)  # fmt: skip
TORCH_PEAK = MetricSpec(
    "gpuwatch_gpu_process_torch_peak_allocated_bytes",
    "gauge",
    "PyTorch's peak allocated (max_memory_allocated): since the process started or its own last reset.",
    _L,
    _TORCH,
)
DROPPED = MetricSpec(
    "gpuwatch_gpu_process_series_dropped",
    "gauge",
    "Processes left out of this scrape by the series cap.",
    (),
)

METRICS = (
    MEMORY,
    SM,
    START,
    ORPHANED,
    TORCH_ALLOCATED,
    TORCH_RESERVED,
    TORCH_FREE_CACHED,
    TORCH_PEAK,
    DROPPED,
)


class ProcessCollector:
    name = "process"

    def __init__(
        self, source: Callable[[], HostSnapshot | None], *, enabled: bool, max_series: int
    ) -> None:
        self._source = source
        self._enabled = enabled
        self._max = max_series

    def collect(self) -> Iterable[Metric]:
        snapshot = self._source()
        families = Families(METRICS)
        if snapshot is None:
            return []
        rows = [
            (gpu, proc)
            for gpu in snapshot.gpus
            for proc in gpu.processes
            if self._enabled or proc.torch is not None
        ]
        rows.sort(key=lambda row: row[1].used_bytes or 0, reverse=True)
        # One series per PID and GPU: the snapshot may list a PID once per context kind
        # (compute and graphics), and ``kind`` is not a label, so a second row would repeat
        # the first's label set (Prometheus drops it). The sampler merges them; a snapshot
        # from elsewhere may not. Sorted first, so the larger figure is kept.
        rows = _one_per_pid(rows)
        kept = rows[: self._max]
        for gpu, proc in kept:
            _add_process(families, gpu, proc, full=self._enabled)
        families.add(DROPPED, (), len(rows) - len(kept))
        return families.collected()


def _one_per_pid(rows: list[tuple[Gpu, GpuProcess]]) -> list[tuple[Gpu, GpuProcess]]:
    """The first row of each (GPU, PID), in order."""
    seen: set[tuple[int, int]] = set()
    kept = []
    for gpu, proc in rows:
        if (gpu.index, proc.pid) not in seen:
            seen.add((gpu.index, proc.pid))
            kept.append((gpu, proc))
    return kept


def _labels(gpu: Gpu, proc: GpuProcess) -> tuple[str, ...]:
    owner = proc.owner
    return (
        str(gpu.index),
        gpu.uuid,
        "" if proc.gpu_instance_id is None else str(proc.gpu_instance_id),
        str(proc.pid),
        owner.user or "",
        (proc.name or "")[:32],
        (owner.container_id or "")[:12],
        owner.pod_uid or "",
        owner.slurm_job_id or "",
    )


def _add_process(f: Families, gpu: Gpu, proc: GpuProcess, *, full: bool) -> None:
    labels = _labels(gpu, proc)
    if full:
        f.add(MEMORY, labels, proc.used_bytes)
        f.add(SM, labels, proc.sm_ratio)
        f.add(START, labels, proc.start_time)
        f.add(ORPHANED, labels, _orphaned(proc))
    if proc.torch is not None:
        f.add(TORCH_ALLOCATED, labels, proc.torch.allocated_bytes)
        f.add(TORCH_RESERVED, labels, proc.torch.reserved_bytes)
        f.add(TORCH_FREE_CACHED, labels, proc.torch.reserved_unallocated_bytes)
        f.add(TORCH_PEAK, labels, proc.torch.peak_allocated_bytes)


def _orphaned(proc: GpuProcess) -> float | None:
    """1 for a holder the GPU's dead or orphaned memory counts, 0 for one it does not;
    None for a PID the agent cannot see now (hidden, or gone and not yet confirmed)."""
    if not proc.visible:
        return None
    gone = not proc.alive or proc.orphaned or proc.jupyter_server_alive is False
    return 1.0 if gone else 0.0
