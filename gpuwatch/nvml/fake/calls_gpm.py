"""GPU Performance Monitoring (GPM): activity between two samples, per GPU or MIG instance.

Real GPM (Hopper and later) works like this: allocate sample buffers
(``nvmlGpmSampleAlloc``), fill one with the device's counters now
(``nvmlGpmSampleGet``, or ``nvmlGpmMigSampleGet(parent, gpuInstanceId, ...)`` for one MIG
instance), fill another later, and ask ``nvmlGpmMetricsGet`` for metrics over the time
between them. It is the only NVML way to see a MIG instance's activity.

The fake's sample holds what the counters would: activities integrated since boot
(:meth:`FakeHost.busy_percent_seconds`, ``tensor_percent_seconds``,
``dram_percent_seconds``) and the scenario time. Between two samples, each metric is the
mean over the interval (the value at the second sample when no scenario time passed,
e.g. a frozen scenario): ``GRAPHICS_UTIL`` and ``SM_UTIL`` the engine activity,
``ANY_TENSOR_UTIL`` the tensor activity, ``DRAM_BW_UTIL`` the memory activity, and, for
a whole GPU, ``PCIE_TX/RX_PER_SEC`` the PCIe traffic ``nvmlDeviceGetPcieThroughput``
reports, in MiB/s. Other metrics (and PCIe on a MIG instance) answer NOT_SUPPORTED in
their own return code. A GPU without ``gpm`` (before Hopper, e.g. an A100) reports
``isSupportedDevice = 0`` and NOT_SUPPORTED for samples, as real drivers do.
"""

from __future__ import annotations

import ctypes
import itertools
import threading
from dataclasses import dataclass
from typing import Any

import pynvml as nv

from gpuwatch.nvml.fake import cargs
from gpuwatch.nvml.fake.calls_health import PCIE_BUSY_KBPS, PCIE_IDLE_KBPS
from gpuwatch.nvml.fake.symbols import CallsBase, DeviceRef, nvml_symbol

# Sample buffer addresses: a range apart from device handle tokens (cargs).
_SAMPLE_BASE = 0x6771_0000_0000
# Metric -> which of a sample's activities (_Reading.busy/now) it reads.
_ACTIVITY = {
    nv.NVML_GPM_METRIC_GRAPHICS_UTIL: 0,
    nv.NVML_GPM_METRIC_SM_UTIL: 0,
    nv.NVML_GPM_METRIC_ANY_TENSOR_UTIL: 1,
    nv.NVML_GPM_METRIC_DRAM_BW_UTIL: 2,
}
_PCIE = frozenset({nv.NVML_GPM_METRIC_PCIE_TX_PER_SEC, nv.NVML_GPM_METRIC_PCIE_RX_PER_SEC})
_MIB = 2**20


@dataclass(frozen=True)
class _Reading:
    gpu: int
    mig: int | None  # MIG instance index on that GPU; None: the whole GPU
    t: float  # scenario seconds
    busy: tuple[float, float, float]  # engine, tensor, DRAM: percent x seconds since boot


class GpmSamples:
    """The sample buffers handed out: address -> reading (None until first filled)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._next = itertools.count(1)
        self._samples: dict[int, _Reading | None] = {}

    def alloc(self) -> int:
        with self._lock:
            address = _SAMPLE_BASE + next(self._next)
            self._samples[address] = None
            return address

    def free(self, address: int | None) -> bool:
        with self._lock:
            return self._samples.pop(address or 0, False) is not False

    def __len__(self) -> int:
        with self._lock:
            return len(self._samples)

    def known(self, address: int | None) -> bool:
        with self._lock:
            return address in self._samples

    def fill(self, address: int, reading: _Reading) -> None:
        with self._lock:
            self._samples[address] = reading

    def get(self, address: int | None) -> _Reading | None:
        with self._lock:
            return self._samples.get(address or 0)


def _address(pointer: Any) -> int | None:
    """The address a ``c_nvmlGpmSample_t`` holds (None for NULL or a non-pointer)."""
    try:
        return ctypes.cast(pointer, ctypes.c_void_p).value
    except (ctypes.ArgumentError, TypeError):
        return None


class GpmCalls(CallsBase):
    gpm_samples: GpmSamples

    @nvml_symbol("nvmlGpmQueryDeviceSupport")
    def gpm_query_device_support(self, device: DeviceRef, t: float, support: Any) -> int:
        struct = cargs.target(support) if support is not None else None
        if struct is None:
            return nv.NVML_ERROR_INVALID_ARGUMENT
        if getattr(struct, "version", None) != nv.NVML_GPM_SUPPORT_VERSION:
            return nv.NVML_ERROR_ARGUMENT_VERSION_MISMATCH
        struct.isSupportedDevice = int(device.gpu.gpm)
        return nv.NVML_SUCCESS

    @nvml_symbol("nvmlGpmSampleAlloc", scope="system")
    def gpm_sample_alloc(self, t: float, sample: Any) -> int:
        if sample is None:
            return nv.NVML_ERROR_INVALID_ARGUMENT
        cargs.set_handle(sample, self.gpm_samples.alloc())
        return nv.NVML_SUCCESS

    @nvml_symbol("nvmlGpmSampleFree", scope="system")
    def gpm_sample_free(self, t: float, sample: Any) -> int:
        if not self.gpm_samples.free(_address(sample)):
            return nv.NVML_ERROR_INVALID_ARGUMENT
        return nv.NVML_SUCCESS

    @nvml_symbol("nvmlGpmSampleGet")
    def gpm_sample_get(self, device: DeviceRef, t: float, sample: Any) -> int:
        return self._sample(device, None, t, sample)

    @nvml_symbol("nvmlGpmMigSampleGet")
    def gpm_mig_sample_get(
        self, device: DeviceRef, t: float, gpu_instance_id: Any, sample: Any
    ) -> int:
        wanted = int(cargs.value(gpu_instance_id))
        position = next((m.index for m in device.gpu.mig if m.gpu_instance_id == wanted), None)
        if device.gpu.gpm and position is None:
            return nv.NVML_ERROR_INVALID_ARGUMENT  # no such GPU instance (or not in MIG mode)
        return self._sample(device, position, t, sample)

    def _sample(self, device: DeviceRef, mig: int | None, t: float, sample: Any) -> int:
        if not device.gpu.gpm:
            return nv.NVML_ERROR_NOT_SUPPORTED
        address = _address(sample)
        if not self.gpm_samples.known(address):
            return nv.NVML_ERROR_INVALID_ARGUMENT
        assert address is not None
        index, host = device.index, self.host
        busy = (
            host.busy_percent_seconds(index, t, mig=mig),
            host.tensor_percent_seconds(index, t, mig=mig),
            host.dram_percent_seconds(index, t, mig=mig),
        )
        self.gpm_samples.fill(address, _Reading(index, mig, t, busy))
        return nv.NVML_SUCCESS

    def _now(self, reading: _Reading) -> list[float]:
        host, gpu, mig, t = self.host, reading.gpu, reading.mig, reading.t
        return [
            float(host.activity_percent(gpu, t, mig=mig)),
            host.tensor_percent(gpu, t, mig=mig),
            float(host.dram_percent(gpu, t, mig=mig)),
        ]

    @nvml_symbol("nvmlGpmMetricsGet", scope="system")
    def gpm_metrics_get(self, t: float, request: Any) -> int:
        struct = cargs.target(request) if request is not None else None
        if struct is None:
            return nv.NVML_ERROR_INVALID_ARGUMENT
        if getattr(struct, "version", None) != nv.NVML_GPM_METRICS_GET_VERSION:
            return nv.NVML_ERROR_ARGUMENT_VERSION_MISMATCH
        first = self.gpm_samples.get(_address(struct.sample1))
        second = self.gpm_samples.get(_address(struct.sample2))
        if (
            first is None
            or second is None
            or (first.gpu, first.mig) != (second.gpu, second.mig)
            or not 0 < struct.numMetrics <= len(struct.metrics)
        ):
            return nv.NVML_ERROR_INVALID_ARGUMENT
        elapsed = second.t - first.t
        if elapsed < 0:
            return nv.NVML_ERROR_INVALID_ARGUMENT  # sample2 must be the later one
        if elapsed > 0:
            means = [(b - a) / elapsed for a, b in zip(first.busy, second.busy, strict=True)]
        else:  # no scenario time passed (frozen): the activities at that moment
            means = self._now(second)
        for metric in struct.metrics[: struct.numMetrics]:
            which = _ACTIVITY.get(metric.metricId)
            metric.value, metric.nvmlReturn = 0.0, nv.NVML_ERROR_NOT_SUPPORTED
            if which is not None:
                metric.value = min(100.0, max(0.0, means[which]))
                metric.nvmlReturn = nv.NVML_SUCCESS
            elif metric.metricId in _PCIE and second.mig is None:
                kbps = PCIE_IDLE_KBPS + PCIE_BUSY_KBPS * min(100.0, max(0.0, means[0])) / 100
                metric.value = kbps * 1000 / _MIB  # KB/s -> MiB/s, as nvml.h gives it
                metric.nvmlReturn = nv.NVML_SUCCESS
        return nv.NVML_SUCCESS
