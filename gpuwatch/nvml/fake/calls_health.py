"""Health symbols: energy, clock event (throttle) reasons, ECC, retired pages, remapped
rows, PCIe replays and throughput, and ``nvmlDeviceGetFieldValues``.

Values come from the GPU's ``health`` keys (docs/scenarios.md); a healthy board by
default. Which boards support what follows real drivers: page retirement before Ampere,
row remapping from Ampere on (the other answers NOT_SUPPORTED), error counts only with
ECC enabled, memory temperature only where the scenario gives a sensor.
"""

from __future__ import annotations

from typing import Any

import pynvml as nv

from gpuwatch.nvml.fake import cargs
from gpuwatch.nvml.fake.symbols import CallsBase, DeviceRef, nvml_symbol

_OK = nv.NVML_SUCCESS
_BAD = nv.NVML_ERROR_INVALID_ARGUMENT
_UNSUPPORTED = nv.NVML_ERROR_NOT_SUPPORTED
_ALL_REASONS = 0x1FF  # every nvmlClocksEventReason* bit the fake can report
# PCIe traffic, KB/s: a trickle when idle, growing with utilisation (not simulated further).
PCIE_IDLE_KBPS = 200
PCIE_BUSY_KBPS = 60_000
_WIDE_FIELDS = (nv.NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION, nv.NVML_FI_DEV_PCIE_REPLAY_COUNTER)


def _put(out: Any, number: int) -> int:
    if out is None:
        return _BAD
    cargs.store(out, number)
    return _OK


class HealthCalls(CallsBase):
    @nvml_symbol("nvmlDeviceGetTotalEnergyConsumption")
    def device_get_total_energy_consumption(
        self, device: DeviceRef, t: float, millijoules: Any
    ) -> int:
        """Millijoules since the scenario booted (the driver loaded), never decreasing."""
        return _put(millijoules, int(self.host.energy_joules(device.index, t) * 1000))

    @nvml_symbol(
        "nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons"
    )
    def device_get_current_clocks_event_reasons(
        self, device: DeviceRef, t: float, reasons: Any
    ) -> int:
        return _put(reasons, self.host.throttle_mask(device.index, t))

    @nvml_symbol(
        "nvmlDeviceGetSupportedClocksEventReasons", "nvmlDeviceGetSupportedClocksThrottleReasons"
    )
    def device_get_supported_clocks_event_reasons(
        self, device: DeviceRef, t: float, reasons: Any
    ) -> int:
        return _put(reasons, _ALL_REASONS)

    # -- ECC ----------------------------------------------------------------------------

    @nvml_symbol("nvmlDeviceGetEccMode")
    def device_get_ecc_mode(self, device: DeviceRef, t: float, current: Any, pending: Any) -> int:
        if current is None or pending is None:
            return _BAD
        mode = nv.NVML_FEATURE_ENABLED if device.gpu.health.ecc else nv.NVML_FEATURE_DISABLED
        cargs.store(current, mode)
        cargs.store(pending, mode)
        return _OK

    @nvml_symbol("nvmlDeviceGetTotalEccErrors")
    def device_get_total_ecc_errors(
        self, device: DeviceRef, t: float, error_type: Any, counter_type: Any, count: Any
    ) -> int:
        """Volatile and aggregate read the same: the fake board has no earlier history."""
        health = device.gpu.health
        if not health.ecc:
            return _UNSUPPORTED
        kind = cargs.value(error_type)
        if kind == nv.NVML_MEMORY_ERROR_TYPE_CORRECTED:
            timeline = health.ecc_corrected
        elif kind == nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED:
            timeline = health.ecc_uncorrected
        else:
            return _BAD
        if cargs.value(counter_type) not in (nv.NVML_VOLATILE_ECC, nv.NVML_AGGREGATE_ECC):
            return _BAD
        return _put(count, int(timeline.at(t)))

    # -- retired pages (before Ampere) and remapped rows (Ampere on) -------------------

    @nvml_symbol("nvmlDeviceGetRetiredPages", "nvmlDeviceGetRetiredPages_v2")
    def device_get_retired_pages(
        self, device: DeviceRef, t: float, cause: Any, count: Any, addresses: Any, *times: Any
    ) -> int:
        """The sizing protocol of the process lists; addresses are made up, one page apart."""
        if device.gpu.remaps_rows:
            return _UNSUPPORTED
        health = device.gpu.health
        which = cargs.value(cause)
        if which == nv.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS:
            pages, base = int(health.retired_pages_single_bit.at(t)), 0x1000_0000
        elif which == nv.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR:
            pages, base = int(health.retired_pages_double_bit.at(t)), 0x2000_0000
        else:
            return _BAD
        if count is None:
            return _BAD
        capacity = 0 if addresses is None else int(cargs.value(count))
        cargs.store(count, pages)
        if pages > capacity:
            return nv.NVML_ERROR_INSUFFICIENT_SIZE
        for i in range(pages):
            addresses[i] = base + i * 0x1000
            if times and times[0] is not None:
                times[0][i] = 0
        return _OK

    @nvml_symbol("nvmlDeviceGetRetiredPagesPendingStatus")
    def device_get_retired_pages_pending_status(
        self, device: DeviceRef, t: float, pending: Any
    ) -> int:
        if device.gpu.remaps_rows:
            return _UNSUPPORTED
        flag = device.gpu.health.retired_pages_pending
        return _put(pending, nv.NVML_FEATURE_ENABLED if flag else nv.NVML_FEATURE_DISABLED)

    @nvml_symbol("nvmlDeviceGetRemappedRows")
    def device_get_remapped_rows(
        self, device: DeviceRef, t: float, corrected: Any, uncorrected: Any, pending: Any,
        failure: Any,
    ) -> int:  # fmt: skip
        if not device.gpu.remaps_rows:
            return _UNSUPPORTED
        if None in (corrected, uncorrected, pending, failure):
            return _BAD
        health = device.gpu.health
        cargs.store(corrected, int(health.remapped_rows_correctable.at(t)))
        cargs.store(uncorrected, int(health.remapped_rows_uncorrectable.at(t)))
        cargs.store(pending, int(health.remapped_rows_pending))
        cargs.store(failure, int(health.remapped_rows_failure))
        return _OK

    # -- PCIe ---------------------------------------------------------------------------

    @nvml_symbol("nvmlDeviceGetPcieReplayCounter")
    def device_get_pcie_replay_counter(self, device: DeviceRef, t: float, count: Any) -> int:
        return _put(count, int(device.gpu.health.pcie_replay.at(t)))

    @nvml_symbol("nvmlDeviceGetPcieThroughput")
    def device_get_pcie_throughput(
        self, device: DeviceRef, t: float, counter: Any, kbps: Any
    ) -> int:
        """KB/s over the last 20 ms: a trickle when idle, more with utilisation."""
        if cargs.value(counter) not in (nv.NVML_PCIE_UTIL_TX_BYTES, nv.NVML_PCIE_UTIL_RX_BYTES):
            return _BAD
        busy = self.host.utilization_percent(device.index, t) / 100
        return _put(kbps, round(PCIE_IDLE_KBPS + PCIE_BUSY_KBPS * busy))

    # -- field values -------------------------------------------------------------------

    @nvml_symbol("nvmlDeviceGetFieldValues")
    def device_get_field_values(self, device: DeviceRef, t: float, count: Any, values: Any) -> int:
        """Fields the fake knows (memory temperature, energy, PCIe replays, NVLink link
        count: 0, NVLink is not simulated); every other field answers NOT_SUPPORTED in
        its own ``nvmlReturn``, and the call itself succeeds, as NVML does."""
        array = cargs.target(values) if values is not None else None
        wanted = int(cargs.value(count))
        if array is None or wanted <= 0:
            return _BAD
        for slot in array[:wanted]:
            number = self._field(device, t, int(slot.fieldId))
            slot.timestamp = int(self.host.clock() * 1_000_000)
            slot.latencyUsec = 0
            if number is None:
                slot.nvmlReturn = _UNSUPPORTED
                continue
            slot.nvmlReturn = _OK
            # Counters are 64-bit in NVML; temperatures and link counts unsigned ints.
            if slot.fieldId in _WIDE_FIELDS:
                slot.valueType = nv.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
                slot.value.ullVal = number
            else:
                slot.valueType = nv.NVML_VALUE_TYPE_UNSIGNED_INT
                slot.value.uiVal = number
        return _OK

    def _field(self, device: DeviceRef, t: float, field: int) -> int | None:
        health = device.gpu.health
        if field == nv.NVML_FI_DEV_MEMORY_TEMP:
            sensor = health.memory_temperature_celsius
            return None if sensor is None else max(0, round(sensor.at(t)))
        if field == nv.NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION:
            return int(self.host.energy_joules(device.index, t) * 1000)
        if field == nv.NVML_FI_DEV_PCIE_REPLAY_COUNTER:
            return int(health.pcie_replay.at(t))
        if field == nv.NVML_FI_DEV_NVLINK_LINK_COUNT:
            return 0
        return None
