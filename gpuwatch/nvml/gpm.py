"""Hardware activity of each GPU and MIG instance, from GPU Performance Monitoring (GPM).

GPM (Hopper and later, driver R520+) reads the hardware counters DCGM's profiler reads:
engine, SM, tensor-pipe, DRAM and PCIe activity, which ``nvmlDeviceGetUtilizationRates``
does not give (it only says whether *a* kernel ran). In MIG mode it is the one way to see
an instance's activity (``nvidia-smi`` shows utilisation "N/A"). GPM works on pairs of
samples: each poll takes one sample per GPU (``nvmlGpmSampleGet``) and one per MIG
instance (``nvmlGpmMigSampleGet(parent, gpuInstanceId, sample)``) and asks one
``nvmlGpmMetricsGet`` per sample pair for every metric in :data:`GPM_METRICS` between it
and the previous poll's sample, so each figure covers exactly the time since the
previous poll (the first poll of a session, or of a new instance, has no pair: ``None``).

Units (``nvml.h``): the utilisations are percent, 0.0-100.0, turned into 0-1 ratios
here; PCIe traffic is MiB/s, turned into bytes/s. A metric the driver answers with an
error in its own return code is ``None`` (unknown), never 0.

``MigReading.activity_ratio`` (the reaper's idleness signal) is GRAPHICS_UTIL rounded to
a whole percent, like every other NVML utilisation figure, so an instance busy under
0.5 % of the time reads 0.

A mixin of :class:`~gpuwatch.nvml.library.NvmlSession`: it calls NVML only through the
session's error boundary and the pynvml module the session holds. Support is asked
once per device (``nvmlGpmQueryDeviceSupport``); a device without GPM (an A100, an
older driver) is logged once and its readings stay ``None``. Two sample buffers per GPU
and per instance are allocated once and reused; they are freed when the instance goes
away, the GPU is lost, or the session closes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gpuwatch.nvml.library import DeviceReading

log = logging.getLogger(__name__)

_MIB = 2**20

# (GpmActivity field, pynvml constant, bytes per unit or None for a 0-100 percentage).
GPM_METRICS: tuple[tuple[str, str, int | None], ...] = (
    ("graphics_ratio", "NVML_GPM_METRIC_GRAPHICS_UTIL", None),
    ("sm_active_ratio", "NVML_GPM_METRIC_SM_UTIL", None),
    ("sm_occupancy_ratio", "NVML_GPM_METRIC_SM_OCCUPANCY", None),
    ("tensor_ratio", "NVML_GPM_METRIC_ANY_TENSOR_UTIL", None),
    ("tensor_dfma_ratio", "NVML_GPM_METRIC_DFMA_TENSOR_UTIL", None),
    ("tensor_hmma_ratio", "NVML_GPM_METRIC_HMMA_TENSOR_UTIL", None),
    ("tensor_imma_ratio", "NVML_GPM_METRIC_IMMA_TENSOR_UTIL", None),
    ("dram_ratio", "NVML_GPM_METRIC_DRAM_BW_UTIL", None),
    ("fp64_ratio", "NVML_GPM_METRIC_FP64_UTIL", None),
    ("fp32_ratio", "NVML_GPM_METRIC_FP32_UTIL", None),
    ("fp16_ratio", "NVML_GPM_METRIC_FP16_UTIL", None),
    ("pcie_tx_bytes_per_second", "NVML_GPM_METRIC_PCIE_TX_PER_SEC", _MIB),
    ("pcie_rx_bytes_per_second", "NVML_GPM_METRIC_PCIE_RX_PER_SEC", _MIB),
)


@dataclass(frozen=True)
class GpmActivity:
    """GPM metrics between two samples; ``None``: the driver did not answer that one.

    Ratios are 0-1 shares of the interval (of cycles, for the pipes; of warp slots, for
    occupancy; of peak bandwidth, for DRAM); PCIe is bytes/s, header and payload.
    """

    graphics_ratio: float | None = None
    sm_active_ratio: float | None = None
    sm_occupancy_ratio: float | None = None
    tensor_ratio: float | None = None
    tensor_dfma_ratio: float | None = None
    tensor_hmma_ratio: float | None = None
    tensor_imma_ratio: float | None = None
    dram_ratio: float | None = None
    fp64_ratio: float | None = None
    fp32_ratio: float | None = None
    fp16_ratio: float | None = None
    pcie_tx_bytes_per_second: float | None = None
    pcie_rx_bytes_per_second: float | None = None


@dataclass
class _Pair:
    """One sampled entity's buffers: ``previous`` (filled by the last poll, if
    ``filled``) and ``spare`` (filled by this one)."""

    previous: Any
    spare: Any
    filled: bool = False


# Buffers are keyed by (GPU index, GPU instance id); the whole GPU is instance None.
_Key = tuple[int, int | None]


@dataclass
class GpmState:
    """Per-session memory of GPM: which devices support it, each entity's buffers."""

    supported: dict[int, bool] = field(default_factory=dict)
    pairs: dict[_Key, _Pair] = field(default_factory=dict)
    request: Any = None  # one nvmlGpmMetricsGet_t, reused (it holds ~19 KiB of slots)
    metric_ids: tuple[int, ...] | None = None  # GPM_METRICS' ids in this pynvml


class GpmReads:
    """The GPM half of reading a device (see the module docstring)."""

    _nv: ModuleType
    _gpm: GpmState

    # Provided by NvmlSession: the error boundary.
    def _call(self, function: str, *args: Any, symbol: str | None = None) -> Any:
        raise NotImplementedError

    def _read_gpm(self, index: int, handle: Any, reading: DeviceReading) -> None:
        """Set ``reading.gpm`` and each MIG instance's ``gpm``."""
        ids = {m.gpu_instance_id for m in reading.mig if m.gpu_instance_id is not None}
        self._drop_pairs(index, keep=frozenset({None, *ids}))
        # An nvidia-ml-py without the GPM wrappers: nothing to ask.
        if not hasattr(self._nv, "nvmlGpmMigSampleGet"):
            return
        if not self._gpm_supported(index, handle):
            return
        reading.gpm = self._activity((index, None), "nvmlGpmSampleGet", handle)
        for instance in reading.mig:
            instance_id = instance.gpu_instance_id
            if instance_id is None:
                continue
            instance.gpm = self._activity(
                (index, instance_id), "nvmlGpmMigSampleGet", handle, instance_id
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
                "GPU %d has no GPM (before Hopper, or an older driver): its profiling "
                "figures are absent, its MIG instances' activity is unknown, and their "
                "processes are never idle for the reaper",
                index,
            )
        return supported

    def _activity(self, key: _Key, function: str, *args: Any) -> GpmActivity | None:
        """Sample ``key`` now (``function(*args, sample)``); the metrics since its
        previous sample, if there is one."""
        pair = self._gpm.pairs.get(key)
        if pair is None:
            first = self._call("nvmlGpmSampleAlloc")
            second = self._call("nvmlGpmSampleAlloc") if first is not None else None
            if second is None:
                if first is not None:
                    self._call("nvmlGpmSampleFree", first)
                return None
            pair = self._gpm.pairs[key] = _Pair(first, second)
        if self._call(function, *args, pair.spare) is None:
            # Counters are cumulative: the previous sample still pairs with the next one.
            return None
        activity = self._metrics(pair.previous, pair.spare) if pair.filled else None
        pair.previous, pair.spare, pair.filled = pair.spare, pair.previous, True
        return activity

    def _metrics(self, first: Any, second: Any) -> GpmActivity | None:
        nv = self._nv
        request = self._gpm.request
        if request is None:
            request = self._gpm.request = nv.c_nvmlGpmMetricsGet_t()
        ids = self._gpm.metric_ids
        if ids is None:
            ids = self._gpm.metric_ids = tuple(getattr(nv, name) for _, name, _ in GPM_METRICS)
        request.version = nv.NVML_GPM_METRICS_GET_VERSION
        request.numMetrics = len(ids)
        request.sample1 = first
        request.sample2 = second
        for slot, metric_id in zip(request.metrics, ids, strict=False):
            slot.metricId = metric_id
        answer = self._call("nvmlGpmMetricsGet", request)
        if answer is None:
            return None
        values: dict[str, float] = {}
        success = nv.NVML_SUCCESS
        for (name, _, unit), metric in zip(GPM_METRICS, answer.metrics, strict=False):
            if metric.nvmlReturn != success:
                continue
            value = float(metric.value)
            if unit is None:
                # 4 decimals (0.01 %): finer than any counter's resolution over a poll.
                values[name] = round(min(max(value, 0.0), 100.0) / 100.0, 4)
            else:
                values[name] = float(round(max(value, 0.0) * unit))
        return GpmActivity(**values)

    def _drop_pairs(self, index: int, *, keep: frozenset[int | None] = frozenset()) -> None:
        """Free the buffers of ``index``'s entities not in ``keep`` (gone, or GPU lost)."""
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
