"""Activity of each MIG instance, from GPU Performance Monitoring (GPM).

In MIG mode NVML gives no per-process utilisation and no GPU utilisation
(``nvidia-smi`` shows "N/A"); GPM (Hopper and later, driver R520+) is the one way to see
an instance's activity, and what ``dcgm-exporter``'s ``DCGM_FI_PROF_GR_ENGINE_ACTIVE``
reports per instance. GPM works on pairs of samples: each poll takes one sample per
instance (``nvmlGpmMigSampleGet(parent, gpuInstanceId, sample)``) and asks
``nvmlGpmMetricsGet`` for ``NVML_GPM_METRIC_GRAPHICS_UTIL`` between it and the previous
poll's sample, so the ratio covers exactly the time since the previous poll (the first
poll of a session, or of a new instance, has no pair: ``None``). It is rounded to a
whole percent, like every other NVML utilisation figure, so an instance busy under
0.5 % of the time reads 0.

A mixin of :class:`~gpuwatch.nvml.library.NvmlSession`: it calls NVML only through the
session's error boundary and the pynvml module the session holds. Support is asked
once per device (``nvmlGpmQueryDeviceSupport``); a device without GPM (an A100, an
older driver) is logged once and its instances' activity stays ``None`` (unknown).
Two sample buffers per instance are allocated once and reused; they are freed when
the instance goes away, the GPU is lost, or the session closes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gpuwatch.nvml.library import MigReading

log = logging.getLogger(__name__)


@dataclass
class _Pair:
    """One instance's sample buffers: ``previous`` (filled by the last poll, if
    ``filled``) and ``spare`` (filled by this one)."""

    previous: Any
    spare: Any
    filled: bool = False


@dataclass
class GpmState:
    """Per-session memory of GPM: which devices support it, each instance's buffers."""

    supported: dict[int, bool] = field(default_factory=dict)
    pairs: dict[tuple[int, int], _Pair] = field(default_factory=dict)
    request: Any = None  # one nvmlGpmMetricsGet_t, reused (it holds ~19 KiB of slots)


class GpmReads:
    """The MIG-activity half of reading a device (see the module docstring)."""

    _nv: ModuleType
    _gpm: GpmState

    # Provided by NvmlSession: the error boundary.
    def _call(self, function: str, *args: Any, symbol: str | None = None) -> Any:
        raise NotImplementedError

    def _read_mig_activity(self, index: int, handle: Any, instances: list[MigReading]) -> None:
        """Set ``activity_ratio`` on each instance GPM can measure since the last poll."""
        ids = {m.gpu_instance_id for m in instances if m.gpu_instance_id is not None}
        self._drop_pairs(index, keep=ids)
        # An nvidia-ml-py without the GPM wrappers: nothing to ask.
        if not ids or not hasattr(self._nv, "nvmlGpmMigSampleGet"):
            return
        if not self._gpm_supported(index, handle):
            return
        for instance in instances:
            if instance.gpu_instance_id is not None:
                instance.activity_ratio = self._instance_activity(
                    index, handle, instance.gpu_instance_id
                )

    def _gpm_supported(self, index: int, handle: Any) -> bool:
        known = self._gpm.supported.get(index)
        if known is not None:
            return known
        support = self._call("nvmlGpmQueryDeviceSupport", handle)
        if support is None:
            return False  # a failed ask (counted); asked again next poll
        supported = bool(support.isSupportedDevice)
        self._gpm.supported[index] = supported
        if not supported:
            log.info(
                "GPU %d has no GPM (before Hopper, or an older driver): its MIG instances' "
                "activity is unknown, and their processes are never idle for the reaper",
                index,
            )
        return supported

    def _instance_activity(self, index: int, handle: Any, instance_id: int) -> float | None:
        pair = self._gpm.pairs.get((index, instance_id))
        if pair is None:
            first = self._call("nvmlGpmSampleAlloc")
            second = self._call("nvmlGpmSampleAlloc") if first is not None else None
            if second is None:
                if first is not None:
                    self._call("nvmlGpmSampleFree", first)
                return None
            pair = self._gpm.pairs[(index, instance_id)] = _Pair(first, second)
        if self._call("nvmlGpmMigSampleGet", handle, instance_id, pair.spare) is None:
            # Counters are cumulative: the previous sample still pairs with the next one.
            return None
        ratio = self._graphics_util(pair.previous, pair.spare) if pair.filled else None
        pair.previous, pair.spare, pair.filled = pair.spare, pair.previous, True
        return ratio

    def _graphics_util(self, first: Any, second: Any) -> float | None:
        nv = self._nv
        request = self._gpm.request
        if request is None:
            request = self._gpm.request = nv.c_nvmlGpmMetricsGet_t()
        request.version = nv.NVML_GPM_METRICS_GET_VERSION
        request.numMetrics = 1
        request.sample1 = first
        request.sample2 = second
        request.metrics[0].metricId = nv.NVML_GPM_METRIC_GRAPHICS_UTIL
        answer = self._call("nvmlGpmMetricsGet", request)
        if answer is None:
            return None
        metric = answer.metrics[0]
        if metric.nvmlReturn != nv.NVML_SUCCESS:
            return None
        return min(max(round(float(metric.value)), 0), 100) / 100.0

    def _drop_pairs(self, index: int, *, keep: set[int] | frozenset[int] = frozenset()) -> None:
        """Free the buffers of ``index``'s instances not in ``keep`` (gone, or GPU lost)."""
        for key in [k for k in self._gpm.pairs if k[0] == index and k[1] not in keep]:
            pair = self._gpm.pairs.pop(key)
            self._free_samples(pair)

    def _forget_gpm(self, index: int) -> None:
        """The GPU was lost: its buffers and its support answer go with it."""
        self._drop_pairs(index)
        self._gpm.supported.pop(index, None)

    def _close_gpm(self) -> None:
        for pair in self._gpm.pairs.values():
            self._free_samples(pair)
        self._gpm.pairs.clear()

    def _free_samples(self, pair: _Pair) -> None:
        for sample in (pair.previous, pair.spare):
            try:
                self._nv.nvmlGpmSampleFree(sample)
            except self._nv.NVMLError:
                log.debug("nvmlGpmSampleFree failed", exc_info=True)
