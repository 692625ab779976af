"""dcgm-exporter compatible framebuffer metrics, so existing DCGM dashboards keep working.

Names, units (MiB) and labels follow dcgm-exporter <= 4.8 (``UUID`` label with the
``GPU-`` prefix, ``modelName``, ``pci_bus_id``, ``device``, ``Hostname``). Off by
default (``--dcgm-compat`` / ``GPUWATCH_AGENT_DCGM_COMPAT``); the native ``gpuwatch_gpu_*``
metrics in bytes are the ones to build new dashboards on.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client.metrics_core import Metric

from gpuwatch.metricspec import Families, MetricSpec
from gpuwatch.snapshot import HostSnapshot

_L = ("gpu", "UUID", "pci_bus_id", "device", "modelName", "Hostname")
_MIB = 2**20
_OPT_IN = "opt-in: dcgm_compat"

FB_USED = MetricSpec(
    "DCGM_FI_DEV_FB_USED", "gauge", "Framebuffer memory used (in MiB).", _L, _OPT_IN
)
FB_FREE = MetricSpec(
    "DCGM_FI_DEV_FB_FREE", "gauge", "Framebuffer memory free (in MiB).", _L, _OPT_IN
)
FB_RESERVED = MetricSpec(
    "DCGM_FI_DEV_FB_RESERVED", "gauge", "Framebuffer memory reserved (in MiB).", _L, _OPT_IN
)
FB_TOTAL = MetricSpec(
    "DCGM_FI_DEV_FB_TOTAL", "gauge", "Framebuffer memory total (in MiB).", _L, _OPT_IN
)

METRICS = (FB_USED, FB_FREE, FB_RESERVED, FB_TOTAL)


class DcgmCompatCollector:
    name = "dcgm"

    def __init__(self, source: Callable[[], HostSnapshot | None]) -> None:
        self._source = source

    def collect(self) -> Iterable[Metric]:
        snapshot = self._source()
        families = Families(METRICS)
        for gpu in snapshot.gpus if snapshot else ():
            if gpu.lost or gpu.read_error:
                continue
            labels = (
                str(gpu.index), gpu.uuid, gpu.pci_bus_id or "", f"nvidia{gpu.index}",
                gpu.name or "", snapshot.hostname if snapshot else "",
            )  # fmt: skip
            for spec, value in (
                (FB_USED, gpu.memory_used_bytes),
                (FB_FREE, gpu.memory_free_bytes),
                (FB_RESERVED, gpu.memory_reserved_bytes),
                (FB_TOTAL, gpu.memory_total_bytes),
            ):
                families.add(spec, labels, None if value is None else value // _MIB)
        return families.collected()
