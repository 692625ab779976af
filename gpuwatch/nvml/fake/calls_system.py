"""System-wide symbols and device lookup: versions, device count, handles by index/UUID/PCI."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pynvml as nv

from gpuwatch.nvml.fake import cargs
from gpuwatch.nvml.fake.scenario_values import parse_bus_id
from gpuwatch.nvml.fake.symbols import CallsBase, nvml_symbol


def short_bus_id(bus_id: str) -> str:
    """``"00000000:01:00.0"`` -> ``"0000:01:00.0"`` (the legacy 16-byte form)."""
    domain, _, rest = bus_id.partition(":")
    return f"{domain[-4:]}:{rest}"


class SystemCalls(CallsBase):
    @nvml_symbol("nvmlSystemGetDriverVersion", scope="system")
    def system_get_driver_version(self, t: float, buffer: Any, length: Any) -> int:
        ok = cargs.write_text(buffer, length, self.host.scenario.driver_version)
        return nv.NVML_SUCCESS if ok else nv.NVML_ERROR_INSUFFICIENT_SIZE

    @nvml_symbol("nvmlSystemGetNVMLVersion", scope="system")
    def system_get_nvml_version(self, t: float, buffer: Any, length: Any) -> int:
        ok = cargs.write_text(buffer, length, self.host.scenario.nvml_version)
        return nv.NVML_SUCCESS if ok else nv.NVML_ERROR_INSUFFICIENT_SIZE

    @nvml_symbol(
        "nvmlSystemGetCudaDriverVersion", "nvmlSystemGetCudaDriverVersion_v2", scope="system"
    )
    def system_get_cuda_driver_version(self, t: float, version: Any) -> int:
        if version is None:
            return nv.NVML_ERROR_INVALID_ARGUMENT
        cargs.store(version, self.host.scenario.cuda_driver_version)
        return nv.NVML_SUCCESS

    @nvml_symbol("nvmlSystemGetProcessName", scope="system")
    def system_get_process_name(self, t: float, pid: Any, buffer: Any, length: Any) -> int:
        """The process's executable path, as NVML reads it from /proc (NOT_FOUND if gone)."""
        try:
            raw = Path(f"/proc/{int(cargs.value(pid))}/cmdline").read_bytes()
        except OSError:
            return nv.NVML_ERROR_NOT_FOUND
        name = raw.split(b"\0", 1)[0].decode(errors="replace")
        if not name:
            return nv.NVML_ERROR_NOT_FOUND
        ok = cargs.write_text(buffer, length, name)
        return nv.NVML_SUCCESS if ok else nv.NVML_ERROR_INSUFFICIENT_SIZE

    @nvml_symbol("nvmlDeviceGetCount", "nvmlDeviceGetCount_v2", scope="system")
    def device_get_count(self, t: float, count: Any) -> int:
        if count is None:
            return nv.NVML_ERROR_INVALID_ARGUMENT
        cargs.store(count, len(self.host.scenario.gpus))
        return nv.NVML_SUCCESS

    @nvml_symbol("nvmlDeviceGetHandleByIndex", "nvmlDeviceGetHandleByIndex_v2", scope="index")
    def device_get_handle_by_index(self, gpu: int, t: float, device: Any) -> int:
        if device is None:
            return nv.NVML_ERROR_INVALID_ARGUMENT
        cargs.set_handle(device, cargs.handle_token(gpu, None))
        return nv.NVML_SUCCESS

    def _handle_where(self, t: float, device: Any, matches: Any) -> int:
        for gpu in self.host.scenario.gpus:
            for mig in (None, *gpu.mig):
                if matches(gpu, mig):
                    if self.host.lost(gpu.index, t):
                        return nv.NVML_ERROR_GPU_IS_LOST
                    cargs.set_handle(
                        device, cargs.handle_token(gpu.index, None if mig is None else mig.index)
                    )
                    return nv.NVML_SUCCESS
        return nv.NVML_ERROR_NOT_FOUND

    @nvml_symbol("nvmlDeviceGetHandleByUUID", scope="system")
    def device_get_handle_by_uuid(self, t: float, uuid: Any, device: Any) -> int:
        wanted = cargs.value(uuid)
        if not isinstance(wanted, bytes) or device is None:
            return nv.NVML_ERROR_INVALID_ARGUMENT
        text = wanted.decode(errors="replace")
        return self._handle_where(
            t, device, lambda gpu, mig: (mig.uuid if mig else gpu.uuid) == text
        )

    @nvml_symbol(
        "nvmlDeviceGetHandleByPciBusId", "nvmlDeviceGetHandleByPciBusId_v2", scope="system"
    )
    def device_get_handle_by_pci_bus_id(self, t: float, bus_id: Any, device: Any) -> int:
        wanted = cargs.value(bus_id)
        if not isinstance(wanted, bytes) or device is None:
            return nv.NVML_ERROR_INVALID_ARGUMENT
        address = parse_bus_id(wanted.decode(errors="replace"))
        if address is None:
            return nv.NVML_ERROR_INVALID_ARGUMENT

        def matches(gpu: Any, mig: Any) -> bool:
            return mig is None and parse_bus_id(gpu.pci_bus_id) == address

        return self._handle_where(t, device, matches)
