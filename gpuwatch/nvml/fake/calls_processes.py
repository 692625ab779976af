"""Running-process lists and per-process utilisation samples, with NVML's sizing protocol.

Both follow the C library exactly: the caller first asks with a NULL array and a count
of 0; NVML answers NVML_ERROR_INSUFFICIENT_SIZE and writes the count it needs (or
NVML_SUCCESS with 0 when there is nothing to list). The caller allocates and asks again;
if the list grew in between, the answer is INSUFFICIENT_SIZE again with the new count.
"""

from __future__ import annotations

from typing import Any

import pynvml as nv

from gpuwatch.nvml.fake import cargs
from gpuwatch.nvml.fake.host import ProcessReading
from gpuwatch.nvml.fake.scenario import ProcessKind
from gpuwatch.nvml.fake.symbols import CallsBase, DeviceRef, nvml_symbol

VALUE_NOT_AVAILABLE = 2**64 - 1  # NVML_VALUE_NOT_AVAILABLE for unsigned long long


def _sized_copy(rows: list[Any], array: Any, count: Any, write: Any) -> int:
    """The shared half of the sizing protocol: ``write(slot, row)`` fills one element."""
    if count is None:
        return nv.NVML_ERROR_INVALID_ARGUMENT
    capacity = 0 if array is None else min(int(cargs.value(count)), len(array))
    cargs.store(count, len(rows))
    if len(rows) > capacity:
        return nv.NVML_ERROR_INSUFFICIENT_SIZE
    for slot, row in zip(array or (), rows, strict=False):
        write(slot, row)
    return nv.NVML_SUCCESS


def _write_process(slot: Any, process: ProcessReading) -> None:
    cargs.fill(
        slot,
        pid=process.pid,
        usedGpuMemory=VALUE_NOT_AVAILABLE if process.used_bytes is None else process.used_bytes,
        gpuInstanceId=process.gpu_instance_id,
        computeInstanceId=process.compute_instance_id,
    )


class ProcessCalls(CallsBase):
    def _running(
        self, device: DeviceRef, t: float, kind: ProcessKind, count: Any, infos: Any
    ) -> int:
        rows = [
            p for p in self.host.processes(device.index, t, mig=device.mig_index) if p.kind == kind
        ]
        return _sized_copy(rows, infos, count, _write_process)

    @nvml_symbol(
        "nvmlDeviceGetComputeRunningProcesses",
        "nvmlDeviceGetComputeRunningProcesses_v2",
        "nvmlDeviceGetComputeRunningProcesses_v3",
        mig=True,
    )
    def device_get_compute_running_processes(
        self, device: DeviceRef, t: float, count: Any, infos: Any
    ) -> int:
        return self._running(device, t, "compute", count, infos)

    @nvml_symbol(
        "nvmlDeviceGetGraphicsRunningProcesses",
        "nvmlDeviceGetGraphicsRunningProcesses_v2",
        "nvmlDeviceGetGraphicsRunningProcesses_v3",
        mig=True,
    )
    def device_get_graphics_running_processes(
        self, device: DeviceRef, t: float, count: Any, infos: Any
    ) -> int:
        return self._running(device, t, "graphics", count, infos)

    @nvml_symbol(
        "nvmlDeviceGetMPSComputeRunningProcesses",
        "nvmlDeviceGetMPSComputeRunningProcesses_v2",
        "nvmlDeviceGetMPSComputeRunningProcesses_v3",
        mig=True,
    )
    def device_get_mps_compute_running_processes(
        self, device: DeviceRef, t: float, count: Any, infos: Any
    ) -> int:
        return self._running(device, t, "mps", count, infos)

    @nvml_symbol("nvmlDeviceGetProcessUtilization", mig=True)
    def device_get_process_utilization(
        self, device: DeviceRef, t: float, samples: Any, count: Any, last_seen_us: Any
    ) -> int:
        """Samples newer than ``last_seen_us`` (wall-clock µs) for processes busy on the
        SMs, the video encoder or the decoder.

        NOT_FOUND when there is no such sample (nothing ran since, or the caller has
        already seen the newest); NOT_SUPPORTED in MIG mode, as on real drivers.
        """
        if device.mig is not None or device.gpu.mig:
            return nv.NVML_ERROR_NOT_SUPPORTED
        newest = self.host.latest_sample_us()
        busy = [
            p
            for p in self.host.processes(device.index, t)
            if max(p.sm_percent, p.encoder_percent, p.decoder_percent) > 0
        ]
        if int(cargs.value(last_seen_us)) >= newest or not busy:
            if count is not None:
                cargs.store(count, 0)
            return nv.NVML_ERROR_NOT_FOUND

        def write(slot: Any, process: ProcessReading) -> None:
            cargs.fill(
                slot,
                pid=process.pid,
                timeStamp=newest,
                smUtil=process.sm_percent,
                memUtil=process.memory_busy_percent,
                encUtil=process.encoder_percent,
                decUtil=process.decoder_percent,
            )

        return _sized_copy(busy, samples, count, write)
