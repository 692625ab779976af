"""MIG symbols: mode, instance handles, and the way back from an instance to its GPU.

A GPU is in MIG mode (current and pending) exactly when the scenario gives it
``[[gpu.mig]]`` instances; each instance has one compute instance. A board without MIG
(``mig_capable = false``: an RTX A6000, an L4, a V100) answers NOT_SUPPORTED for its mode.
"""

from __future__ import annotations

from typing import Any

import pynvml as nv

from gpuwatch.nvml.fake import cargs
from gpuwatch.nvml.fake.symbols import CallsBase, DeviceRef, nvml_symbol

# nvmlDeviceGetMaxMigDeviceCount on MIG-capable parts (A100, H100): seven 1g slices.
_MAX_MIG_DEVICES = 7


class MigCalls(CallsBase):
    @nvml_symbol("nvmlDeviceGetMigMode")
    def device_get_mig_mode(self, device: DeviceRef, t: float, current: Any, pending: Any) -> int:
        if current is None or pending is None:
            return nv.NVML_ERROR_INVALID_ARGUMENT
        if not device.gpu.mig_capable:  # NVML: "if device doesn't support MIG mode"
            return nv.NVML_ERROR_NOT_SUPPORTED
        mode = nv.NVML_DEVICE_MIG_ENABLE if device.gpu.mig else nv.NVML_DEVICE_MIG_DISABLE
        cargs.store(current, mode)
        cargs.store(pending, mode)
        return nv.NVML_SUCCESS

    @nvml_symbol("nvmlDeviceGetMaxMigDeviceCount")
    def device_get_max_mig_device_count(self, device: DeviceRef, t: float, count: Any) -> int:
        if count is None:
            return nv.NVML_ERROR_INVALID_ARGUMENT
        cargs.store(count, _MAX_MIG_DEVICES if device.gpu.mig else 0)
        return nv.NVML_SUCCESS

    @nvml_symbol("nvmlDeviceGetMigDeviceHandleByIndex")
    def device_get_mig_device_handle_by_index(
        self, device: DeviceRef, t: float, index: Any, mig: Any
    ) -> int:
        position = int(cargs.value(index))
        if mig is None or position >= _MAX_MIG_DEVICES:
            return nv.NVML_ERROR_INVALID_ARGUMENT
        if position >= len(device.gpu.mig):
            return nv.NVML_ERROR_NOT_FOUND
        cargs.set_handle(mig, cargs.handle_token(device.index, position))
        return nv.NVML_SUCCESS

    @nvml_symbol("nvmlDeviceIsMigDeviceHandle", mig=True)
    def device_is_mig_device_handle(self, device: DeviceRef, t: float, answer: Any) -> int:
        if answer is None:
            return nv.NVML_ERROR_INVALID_ARGUMENT
        cargs.store(answer, int(device.mig is not None))
        return nv.NVML_SUCCESS

    @nvml_symbol("nvmlDeviceGetDeviceHandleFromMigDeviceHandle", mig=True)
    def device_get_device_handle_from_mig_device_handle(
        self, device: DeviceRef, t: float, parent: Any
    ) -> int:
        if device.mig is None or parent is None:
            return nv.NVML_ERROR_INVALID_ARGUMENT
        cargs.set_handle(parent, cargs.handle_token(device.index, None))
        return nv.NVML_SUCCESS

    @nvml_symbol("nvmlDeviceGetGpuInstanceId", mig=True)
    def device_get_gpu_instance_id(self, device: DeviceRef, t: float, instance: Any) -> int:
        if device.mig is None or instance is None:
            return nv.NVML_ERROR_INVALID_ARGUMENT
        cargs.store(instance, device.mig.gpu_instance_id)
        return nv.NVML_SUCCESS

    @nvml_symbol("nvmlDeviceGetComputeInstanceId", mig=True)
    def device_get_compute_instance_id(self, device: DeviceRef, t: float, instance: Any) -> int:
        if device.mig is None or instance is None:
            return nv.NVML_ERROR_INVALID_ARGUMENT
        cargs.store(instance, device.mig.compute_instance_id)
        return nv.NVML_SUCCESS
