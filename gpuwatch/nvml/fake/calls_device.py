"""Per-device symbols: identity, PCI, memory, utilisation, power, thermals, clocks, modes.

Units are NVML's: bytes, percent, milliwatts, degrees Celsius, MHz.
"""

from __future__ import annotations

from typing import Any, Literal

import pynvml as nv

from gpuwatch.nvml.fake import cargs
from gpuwatch.nvml.fake.calls_system import short_bus_id
from gpuwatch.nvml.fake.symbols import CallsBase, DeviceRef, nvml_symbol

_ARCHITECTURES = {
    7: nv.NVML_DEVICE_ARCH_VOLTA,
    8: nv.NVML_DEVICE_ARCH_AMPERE,
    9: nv.NVML_DEVICE_ARCH_HOPPER,
}
_IDLE_CLOCK_MHZ = 345
_BAR1_BASE_BYTES = 16 * 2**20
_BAR1_PER_PROCESS_BYTES = 2 * 2**20

_OK = nv.NVML_SUCCESS
_BAD = nv.NVML_ERROR_INVALID_ARGUMENT


def _put(out: Any, number: int) -> int:
    if out is None:
        return _BAD
    cargs.store(out, number)
    return _OK


def _text(buffer: Any, length: Any, text: str) -> int:
    return _OK if cargs.write_text(buffer, length, text) else nv.NVML_ERROR_INSUFFICIENT_SIZE


class DeviceCalls(CallsBase):
    # -- identity ---------------------------------------------------------------------

    @nvml_symbol("nvmlDeviceGetIndex")
    def device_get_index(self, device: DeviceRef, t: float, index: Any) -> int:
        return _put(index, device.index)

    @nvml_symbol("nvmlDeviceGetName", mig=True)
    def device_get_name(self, device: DeviceRef, t: float, buffer: Any, length: Any) -> int:
        name = (
            device.gpu.name if device.mig is None else f"{device.gpu.name} MIG {device.mig.profile}"
        )
        return _text(buffer, length, name)

    @nvml_symbol("nvmlDeviceGetUUID", mig=True)
    def device_get_uuid(self, device: DeviceRef, t: float, buffer: Any, length: Any) -> int:
        return _text(buffer, length, device.gpu.uuid if device.mig is None else device.mig.uuid)

    @nvml_symbol("nvmlDeviceGetSerial")
    def device_get_serial(self, device: DeviceRef, t: float, buffer: Any, length: Any) -> int:
        digits = "".join(c for c in device.gpu.uuid if c.isdigit())
        return _text(buffer, length, (digits + "0" * 13)[:13])

    @nvml_symbol("nvmlDeviceGetMinorNumber")
    def device_get_minor_number(self, device: DeviceRef, t: float, minor: Any) -> int:
        return _put(minor, device.index)

    @nvml_symbol("nvmlDeviceGetBrand")
    def device_get_brand(self, device: DeviceRef, t: float, brand: Any) -> int:
        return _put(brand, nv.NVML_BRAND_NVIDIA)

    @nvml_symbol("nvmlDeviceGetArchitecture")
    def device_get_architecture(self, device: DeviceRef, t: float, arch: Any) -> int:
        return _put(
            arch, _ARCHITECTURES.get(device.gpu.cuda_capability[0], nv.NVML_DEVICE_ARCH_UNKNOWN)
        )

    @nvml_symbol("nvmlDeviceGetCudaComputeCapability")
    def device_get_cuda_compute_capability(
        self, device: DeviceRef, t: float, major: Any, minor: Any
    ) -> int:
        if major is None or minor is None:
            return _BAD
        cargs.store(major, device.gpu.cuda_capability[0])
        cargs.store(minor, device.gpu.cuda_capability[1])
        return _OK

    @nvml_symbol(
        "nvmlDeviceGetPciInfo", "nvmlDeviceGetPciInfo_v2", "nvmlDeviceGetPciInfo_v3", mig=True
    )
    def device_get_pci_info(self, device: DeviceRef, t: float, info: Any) -> int:
        if info is None:
            return _BAD
        bus_id = device.gpu.pci_bus_id
        domain, bus, rest = bus_id.split(":")
        cargs.fill(
            cargs.target(info),
            busIdLegacy=short_bus_id(bus_id).encode(),
            busId=bus_id.encode(),
            domain=int(domain, 16),
            bus=int(bus, 16),
            device=int(rest.split(".")[0], 16),
            pciDeviceId=device.gpu.pci_device_id,
            pciSubSystemId=0x16A110DE,
        )
        return _OK

    # -- memory -----------------------------------------------------------------------

    @nvml_symbol("nvmlDeviceGetMemoryInfo", mig=True)
    def device_get_memory_info(self, device: DeviceRef, t: float, memory: Any) -> int:
        """v1: ``used`` includes the driver's reserved memory (what nvidia-smi < R515 showed)."""
        if memory is None:
            return _BAD
        reading = self.host.memory(device.index, t, mig=device.mig_index)
        cargs.fill(
            cargs.target(memory),
            total=reading.total,
            used=reading.used + reading.reserved,
            free=reading.free,
        )
        return _OK

    @nvml_symbol("nvmlDeviceGetMemoryInfo_v2", mig=True)
    def device_get_memory_info_v2(self, device: DeviceRef, t: float, memory: Any) -> int:
        """v2: ``total = reserved + used + free``; the struct's version must be nvmlMemory_v2."""
        struct = cargs.target(memory) if memory is not None else None
        if struct is None:
            return _BAD
        if getattr(struct, "version", None) != nv.nvmlMemory_v2:
            return nv.NVML_ERROR_ARGUMENT_VERSION_MISMATCH
        reading = self.host.memory(device.index, t, mig=device.mig_index)
        cargs.fill(
            struct,
            total=reading.total,
            reserved=reading.reserved,
            used=reading.used,
            free=reading.free,
        )
        return _OK

    @nvml_symbol("nvmlDeviceGetBAR1MemoryInfo", mig=True)
    def device_get_bar1_memory_info(self, device: DeviceRef, t: float, bar1: Any) -> int:
        """BAR1 of the GPU, or of a MIG instance: its share of the GPU's BAR1, in
        proportion to its memory (as ``nvidia-smi`` lists BAR1 per MIG device)."""
        if bar1 is None:
            return _BAD
        gpu = device.gpu
        total = gpu.bar1_total
        if device.mig is not None:
            share = device.mig.memory_total / (gpu.memory_total - gpu.memory_reserved)
            total = int(total * share) // 2**20 * 2**20
        processes = self.host.processes(device.index, t, mig=device.mig_index)
        used = min(total, _BAR1_BASE_BYTES + _BAR1_PER_PROCESS_BYTES * len(processes))
        cargs.fill(cargs.target(bar1), bar1Total=total, bar1Used=used, bar1Free=total - used)
        return _OK

    # -- activity ---------------------------------------------------------------------

    @nvml_symbol("nvmlDeviceGetUtilizationRates")
    def device_get_utilization_rates(self, device: DeviceRef, t: float, utilization: Any) -> int:
        """NOT_SUPPORTED in MIG mode, as on real drivers (nvidia-smi shows GPU-Util N/A)."""
        if utilization is None:
            return _BAD
        if device.gpu.mig:
            return nv.NVML_ERROR_NOT_SUPPORTED
        cargs.fill(
            cargs.target(utilization),
            gpu=self.host.utilization_percent(device.index, t),
            memory=self.host.memory_busy_percent(device.index, t),
        )
        return _OK

    @nvml_symbol("nvmlDeviceGetEncoderUtilization")
    def device_get_encoder_utilization(
        self, device: DeviceRef, t: float, utilization: Any, period: Any
    ) -> int:
        return self._codec(device, t, "encoder", utilization, period)

    @nvml_symbol("nvmlDeviceGetDecoderUtilization")
    def device_get_decoder_utilization(
        self, device: DeviceRef, t: float, utilization: Any, period: Any
    ) -> int:
        return self._codec(device, t, "decoder", utilization, period)

    def _codec(
        self,
        device: DeviceRef,
        t: float,
        engine: Literal["encoder", "decoder"],
        utilization: Any,
        period: Any,
    ) -> int:
        if utilization is None or period is None:
            return _BAD
        cargs.store(utilization, self.host.codec_percent(device.index, t, engine))
        cargs.store(period, 167_000)  # microseconds, the driver's usual sampling period
        return _OK

    @nvml_symbol("nvmlDeviceGetPerformanceState", "nvmlDeviceGetPowerState")
    def device_get_performance_state(self, device: DeviceRef, t: float, pstate: Any) -> int:
        busy = bool(self.host.processes(device.index, t))
        return _put(pstate, 0 if busy else 8)

    @nvml_symbol("nvmlDeviceGetClockInfo")
    def device_get_clock_info(self, device: DeviceRef, t: float, clock_type: Any, mhz: Any) -> int:
        kind = cargs.value(clock_type)
        if kind == nv.NVML_CLOCK_MEM:
            return _put(mhz, device.gpu.clock_memory_mhz)
        if kind in (nv.NVML_CLOCK_GRAPHICS, nv.NVML_CLOCK_SM, nv.NVML_CLOCK_VIDEO):
            busy = self.host.utilization_percent(device.index, t) > 0
            return _put(mhz, device.gpu.clock_sm_mhz if busy else _IDLE_CLOCK_MHZ)
        return _BAD

    @nvml_symbol("nvmlDeviceGetMaxClockInfo")
    def device_get_max_clock_info(
        self, device: DeviceRef, t: float, clock_type: Any, mhz: Any
    ) -> int:
        kind = cargs.value(clock_type)
        if kind == nv.NVML_CLOCK_MEM:
            return _put(mhz, device.gpu.clock_memory_mhz)
        if kind in (nv.NVML_CLOCK_GRAPHICS, nv.NVML_CLOCK_SM, nv.NVML_CLOCK_VIDEO):
            return _put(mhz, device.gpu.clock_sm_mhz)
        return _BAD

    # -- power, thermals, fans ----------------------------------------------------------

    @nvml_symbol("nvmlDeviceGetPowerUsage")
    def device_get_power_usage(self, device: DeviceRef, t: float, milliwatts: Any) -> int:
        return _put(milliwatts, round(self.host.power_watts(device.index, t) * 1000))

    @nvml_symbol(
        "nvmlDeviceGetEnforcedPowerLimit",
        "nvmlDeviceGetPowerManagementLimit",
        "nvmlDeviceGetPowerManagementDefaultLimit",
    )
    def device_get_power_limit(self, device: DeviceRef, t: float, milliwatts: Any) -> int:
        return _put(milliwatts, round(device.gpu.power_limit_watts * 1000))

    @nvml_symbol("nvmlDeviceGetTemperature")
    def device_get_temperature(self, device: DeviceRef, t: float, sensor: Any, celsius: Any) -> int:
        if cargs.value(sensor) != nv.NVML_TEMPERATURE_GPU:
            return _BAD
        return _put(celsius, self.host.temperature_celsius(device.index, t))

    @nvml_symbol("nvmlDeviceGetTemperatureV")
    def device_get_temperature_v(self, device: DeviceRef, t: float, reading: Any) -> int:
        struct = cargs.target(reading) if reading is not None else None
        if struct is None:
            return _BAD
        if getattr(struct, "version", None) != nv.nvmlTemperature_v1:
            return nv.NVML_ERROR_ARGUMENT_VERSION_MISMATCH
        if struct.sensorType != nv.NVML_TEMPERATURE_GPU:
            return _BAD
        struct.temperature = self.host.temperature_celsius(device.index, t)
        return _OK

    @nvml_symbol("nvmlDeviceGetNumFans")
    def device_get_num_fans(self, device: DeviceRef, t: float, count: Any) -> int:
        return _put(count, device.gpu.health.fans)

    @nvml_symbol("nvmlDeviceGetFanSpeed")
    def device_get_fan_speed(self, device: DeviceRef, t: float, percent: Any) -> int:
        """NOT_SUPPORTED on passively cooled boards (``fans = 0``), like SXM modules."""
        if device.gpu.health.fans == 0:
            return nv.NVML_ERROR_NOT_SUPPORTED
        return _put(percent, round(device.gpu.fan_percent.at(t)))

    @nvml_symbol("nvmlDeviceGetFanSpeed_v2")
    def device_get_fan_speed_v2(self, device: DeviceRef, t: float, fan: Any, percent: Any) -> int:
        if device.gpu.health.fans == 0:
            return nv.NVML_ERROR_NOT_SUPPORTED
        if not 0 <= cargs.value(fan) < device.gpu.health.fans:
            return _BAD
        return _put(percent, round(device.gpu.fan_percent.at(t)))

    # -- modes and topology -----------------------------------------------------------

    @nvml_symbol("nvmlDeviceGetPersistenceMode")
    def device_get_persistence_mode(self, device: DeviceRef, t: float, state: Any) -> int:
        return _put(state, int(device.gpu.persistence_mode))

    @nvml_symbol("nvmlDeviceGetDisplayActive", "nvmlDeviceGetDisplayMode")
    def device_get_display_active(self, device: DeviceRef, t: float, state: Any) -> int:
        return _put(state, int(device.gpu.display_active))

    @nvml_symbol("nvmlDeviceGetComputeMode")
    def device_get_compute_mode(self, device: DeviceRef, t: float, mode: Any) -> int:
        return _put(mode, nv.NVML_COMPUTEMODE_DEFAULT)

    @nvml_symbol("nvmlDeviceGetAddressingMode")
    def device_get_addressing_mode(self, device: DeviceRef, t: float, mode: Any) -> int:
        """ATS on coherent (Grace Hopper-like) GPUs, where memory accounting differs."""
        struct = cargs.target(mode) if mode is not None else None
        if struct is None:
            return _BAD
        if getattr(struct, "version", None) != nv.nvmlDeviceAddressingMode_v1:
            return nv.NVML_ERROR_ARGUMENT_VERSION_MISMATCH
        coherent = device.gpu.coherent
        struct.value = (
            nv.NVML_DEVICE_ADDRESSING_MODE_ATS if coherent else nv.NVML_DEVICE_ADDRESSING_MODE_NONE
        )
        return _OK

    @nvml_symbol("nvmlDeviceGetNumaNodeId")
    def device_get_numa_node_id(self, device: DeviceRef, t: float, node: Any) -> int:
        """Only coherent GPUs expose their memory as a NUMA node."""
        if not device.gpu.coherent:
            return nv.NVML_ERROR_NOT_SUPPORTED
        return _put(node, 1 + device.index)

    @nvml_symbol("nvmlDeviceGetDriverModel", "nvmlDeviceGetDriverModel_v2")
    def device_get_driver_model(
        self, device: DeviceRef, t: float, current: Any, pending: Any
    ) -> int:
        """WDDM/TCC exist on Windows only; a Linux driver answers NOT_SUPPORTED."""
        return nv.NVML_ERROR_NOT_SUPPORTED
