"""Per-GPU metrics: memory, activity, power, and who (or nothing) accounts for the memory,
plus the health series declared in :mod:`gpuwatch.agent.collectors.health`, the GPM
profiling series declared in :mod:`gpuwatch.agent.collectors.profiling` and the MIG
instances' memory declared in :mod:`gpuwatch.agent.collectors.mig`.

``nvidia-smi --query-gpu=memory.total,memory.used,memory.free,utilization.gpu,...``
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client.metrics_core import Metric

from gpuwatch.agent.collectors import health, mig, profiling
from gpuwatch.metricspec import Families, MetricSpec
from gpuwatch.snapshot import Gpu, HostSnapshot

_L = ("gpu", "uuid")
# Every reading is absent while the GPU is lost or unreadable (gpuwatch_gpu_up 0), and
# on its own when NVML does not answer for it: never "always".
_READ = "while gpuwatch_gpu_up is 1 and NVML reports it"
# Memory is the one whose absence from a readable GPU the shipped rules alert on.
_MEMORY = _READ + "; a readable GPU without it raises the GpuMemoryNotReported alert"
# The dead and orphaned sums are unknown, not 0, while the agent has yet to tell whether
# a PID it cannot see now is gone: after the agent starts, or as a process exits.
_SETTLED = (
    "; absent for the poll where a PID on the GPU first shows as not visible (the first"
    " poll after the agent starts, or a process exiting: its death is confirmed at the next)"
)

INFO = MetricSpec(
    "gpuwatch_gpu",
    "info",
    "GPU identity: model name and PCI bus id.",
    ("gpu", "uuid", "name", "pci_bus_id"),
)
UP = MetricSpec(
    "gpuwatch_gpu_up",
    "gauge",
    "1 if the last poll read this GPU, 0 if it was lost or its read timed out.",
    _L,
)
LOST = MetricSpec(
    "gpuwatch_gpu_lost", "gauge", "1 if NVML reports the GPU lost (fallen off the bus).", _L
)
MEMORY_TOTAL = MetricSpec(
    "gpuwatch_gpu_memory_total_bytes",
    "gauge",
    "Total framebuffer memory.",
    _L,
    availability=_MEMORY,
)
MEMORY_USED = MetricSpec(
    "gpuwatch_gpu_memory_used_bytes",
    "gauge",
    "Framebuffer memory in use (excludes the driver's reserved memory on the v2 API).",
    _L,
    availability=_MEMORY,
)
MEMORY_FREE = MetricSpec(
    "gpuwatch_gpu_memory_free_bytes",
    "gauge",
    "Framebuffer memory free for new allocations.",
    _L,
    availability=_MEMORY,
)
MEMORY_RESERVED = MetricSpec(
    "gpuwatch_gpu_memory_reserved_bytes",
    "gauge",
    "Framebuffer memory reserved by the driver.",
    _L,
    availability="drivers with nvmlDeviceGetMemoryInfo_v2",
)
MEMORY_UNATTRIBUTED = MetricSpec(
    "gpuwatch_gpu_memory_unattributed_bytes",
    "gauge",
    "Memory in use that no listed process accounts for.",
    _L,
    availability="absent on coherent-memory and MIG GPUs, when processes are not visible, when NVML withholds a process's usage, when the driver gives only memory info v1 (its used includes the reserved memory), or when the process list changed during the read",
)
MEMORY_DEAD = MetricSpec(
    "gpuwatch_gpu_memory_dead_process_bytes",
    "gauge",
    "Memory NVML attributes to PIDs that no longer exist on this host.",
    _L,
    availability=_READ + ", when the agent can see the processes" + _SETTLED,
)
MEMORY_ORPHANED = MetricSpec(
    "gpuwatch_gpu_memory_orphaned_bytes",
    "gauge",
    "Memory held by processes whose parent died (reparented) or Jupyter kernels whose server is gone.",
    _L,
    availability=_READ + ", when the agent can see the processes" + _SETTLED,
)
UTILIZATION = MetricSpec(
    "gpuwatch_gpu_utilization_ratio",
    "gauge",
    "Fraction of the last sample period a kernel was running (0-1).",
    _L,
    availability=_READ + "; not in MIG mode (gpuwatch_gpu_activity_ratio has it per instance)",
)
MEMORY_BUSY = MetricSpec(
    "gpuwatch_gpu_memory_busy_ratio",
    "gauge",
    "Fraction of the last sample period the memory controller was busy (0-1); not occupancy.",
    _L,
    availability=_READ + "; not in MIG mode",
)
TEMPERATURE = MetricSpec(
    "gpuwatch_gpu_temperature_celsius", "gauge", "GPU core temperature.", _L, availability=_READ
)
POWER = MetricSpec("gpuwatch_gpu_power_watts", "gauge", "Power draw.", _L, availability=_READ)
POWER_LIMIT = MetricSpec(
    "gpuwatch_gpu_power_limit_watts", "gauge", "Enforced power limit.", _L, availability=_READ
)
PROCESSES = MetricSpec(
    "gpuwatch_gpu_processes",
    "gauge",
    "Processes with a context on the GPU (compute, graphics and MPS).",
    _L,
    availability=_READ,
)

METRICS = (
    INFO, UP, LOST, MEMORY_TOTAL, MEMORY_USED, MEMORY_FREE, MEMORY_RESERVED, MEMORY_UNATTRIBUTED,
    MEMORY_DEAD, MEMORY_ORPHANED, UTILIZATION, MEMORY_BUSY, TEMPERATURE, POWER, POWER_LIMIT, PROCESSES,
    *health.METRICS, *profiling.METRICS, *mig.METRICS,
)  # fmt: skip


class GpuCollector:
    """Renders the latest snapshot's GPUs. ``source`` returns it (``None`` before the first poll)."""

    name = "gpu"

    def __init__(self, source: Callable[[], HostSnapshot | None]) -> None:
        self._source = source
        self._unsettled = UnsettledPids()

    def collect(self) -> Iterable[Metric]:
        snapshot = self._source()
        families = Families(METRICS)
        pending = self._unsettled.update(snapshot) if snapshot else {}
        for gpu in snapshot.gpus if snapshot else ():
            _add_gpu(families, gpu, settled=not pending.get(gpu.uuid))
        return families.collected()


def unknown_pids(gpu: Gpu) -> frozenset[int]:
    """PIDs NVML lists on ``gpu`` that the agent cannot see now: hidden from its
    ``/proc`` (for good), or gone and not yet confirmed dead (the sampler reports a PID
    missing from ``/proc`` dead only at the second poll in a row, so a process's normal
    exit is not a dead PID)."""
    return frozenset(p.pid for p in gpu.processes if p.alive and not p.visible)


class UnsettledPids:
    """Per GPU, the PIDs whose fate the latest snapshot leaves open: not visible now, and
    not already not visible in the snapshot before.

    A PID that stays not visible is hidden (``hidepid``, a ``/proc`` read refused), and
    alive: it changes no sum. One that just turned not visible may be a process gone,
    whose memory the next poll reports as a dead PID's; that is always the case for a
    dead PID at the agent's first poll after a restart. Reporting the dead-process sum
    as 0 meanwhile made it drop to 0 and back at every agent restart, which restarted
    the ``for:`` of the alert on it; absent, it is one missed sample, which the rules
    bridge (``last_over_time``).

    Snapshots are compared in the order the collector sees them: a scrape renders each
    poll once (``ScrapeRenderer``), and one rendered again (same ``sequence``) keeps its
    answer.
    """

    def __init__(self) -> None:
        self._key: tuple[str, str, int] | None = None
        self._before: dict[str, frozenset[int]] = {}
        self._pending: dict[str, frozenset[int]] = {}

    def update(self, snapshot: HostSnapshot) -> dict[str, frozenset[int]]:
        """The unsettled PIDs of each GPU (by UUID) in ``snapshot``; a GPU with none is
        left out. At the first snapshot every PID not visible is unsettled."""
        if snapshot.idempotency_key == self._key:
            return self._pending
        now = {gpu.uuid: unknown_pids(gpu) for gpu in snapshot.gpus}
        pending = {uuid: pids - self._before.get(uuid, frozenset()) for uuid, pids in now.items()}
        self._pending = {uuid: pids for uuid, pids in pending.items() if pids}
        self._before = now
        self._key = snapshot.idempotency_key
        return self._pending


def _add_gpu(f: Families, gpu: Gpu, *, settled: bool = True) -> None:
    labels = (str(gpu.index), gpu.uuid)
    f.add_info(INFO, labels, {"name": gpu.name or "", "pci_bus_id": gpu.pci_bus_id or ""})
    f.add(UP, labels, 0.0 if gpu.lost or gpu.read_error else 1.0)
    f.add(LOST, labels, 1.0 if gpu.lost else 0.0)
    if gpu.lost or gpu.read_error:
        return
    f.add(MEMORY_TOTAL, labels, gpu.memory_total_bytes)
    f.add(MEMORY_USED, labels, gpu.memory_used_bytes)
    f.add(MEMORY_FREE, labels, gpu.memory_free_bytes)
    f.add(MEMORY_RESERVED, labels, gpu.memory_reserved_bytes)
    f.add(MEMORY_UNATTRIBUTED, labels, gpu.unattributed_bytes)
    if gpu.processes_visible and settled:
        dead = sum(p.used_bytes or 0 for p in gpu.processes if p.visible and not p.alive)
        orphaned = sum(
            p.used_bytes or 0
            for p in gpu.processes
            if p.alive and (p.orphaned or p.jupyter_server_alive is False)
        )
        f.add(MEMORY_DEAD, labels, dead)
        f.add(MEMORY_ORPHANED, labels, orphaned)
    f.add(UTILIZATION, labels, gpu.utilization_ratio)
    f.add(MEMORY_BUSY, labels, gpu.memory_busy_ratio)
    f.add(TEMPERATURE, labels, gpu.temperature_celsius)
    f.add(POWER, labels, gpu.power_watts)
    f.add(POWER_LIMIT, labels, gpu.power_limit_watts)
    f.add(PROCESSES, labels, len({p.pid for p in gpu.processes}))
    health.add_health(f, gpu)
    profiling.add_profiling(f, gpu)
    mig.add_mig_memory(f, gpu)
