"""Health reads of one GPU: clocks, energy, fans, throttling, ECC, retirement, Xid.

A mixin of :class:`~gpuwatch.nvml.library.NvmlSession`; it calls NVML only through the
session's error boundary (``_call``) and the pynvml module the session holds, so
``library.py`` stays the one importer of pynvml.

What a board does not report (NOT_SUPPORTED: fans on a passively cooled module, page
retirement on Ampere and later, ECC counts with ECC off) is a property of the board:
it is asked once per device, counted once in the NVML error counts, and then left
alone. Other failures are asked again on the next poll.

Xid errors come from an NVML event set per device, registered on the device's first
read: the count is of events since then (``nvidia-smi`` has no such counter; dmesg's
``NVRM: Xid`` lines are the same events). Events from before the agent started are not
seen, as NVML does not replay them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gpuwatch.nvml.library import DeviceReading

log = logging.getLogger(__name__)

MHZ = 1_000_000
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_TIMEOUT = 10
NVML_ERROR_FUNCTION_NOT_FOUND = 13
# Events drained per device per poll: a storm beyond this waits for the next poll.
MAX_EVENTS_PER_POLL = 256

# nvmlClocksEventReason* bits (nvml.h) by the names gpuwatch exports them under, in bit order.
THROTTLE_REASONS = (
    ("gpu_idle", 0x1),
    ("applications_clocks_setting", 0x2),
    ("sw_power_cap", 0x4),
    ("hw_slowdown", 0x8),
    ("sync_boost", 0x10),
    ("sw_thermal_slowdown", 0x20),
    ("hw_thermal_slowdown", 0x40),
    ("hw_power_brake_slowdown", 0x80),
    ("display_clock_setting", 0x100),
)

# The DeviceReading fields this module fills, named as in the snapshot's Gpu.
HEALTH_FIELDS = (
    "memory_temperature_celsius", "energy_joules", "clock_sm_hertz", "clock_memory_hertz",
    "fan_ratio", "encoder_ratio", "decoder_ratio", "throttle_reasons",
    "ecc_uncorrected_volatile", "ecc_uncorrected_aggregate",
    "ecc_corrected_volatile", "ecc_corrected_aggregate",
    "retired_pages_single_bit", "retired_pages_double_bit", "retired_pages_pending",
    "remapped_rows_correctable", "remapped_rows_uncorrectable",
    "remapped_rows_pending", "remapped_rows_failure",
    "xid_errors", "xid_last_code", "pcie_replay_errors",
)  # fmt: skip


# Counters at or beyond this are sentinels, not counts (gpuwatch.snapshot.Count's bound).
_COUNT_LIMIT = 2**63


@dataclass
class XidWatch:
    """One device's Xid event set and what it has delivered so far."""

    event_set: Any
    count: int = 0
    last_code: int | None = None


@dataclass
class HealthState:
    """Per-session memory of the health reads: unsupported fields, Xid watches."""

    unsupported: set[tuple[int, str]] = field(default_factory=set)
    # index -> watch; None: the device cannot deliver Xid events.
    xid: dict[int, XidWatch | None] = field(default_factory=dict)


class HealthReads:
    """The health half of reading a device (see the module docstring)."""

    _nv: ModuleType
    _health: HealthState

    # Provided by NvmlSession: the error boundary.
    def _attempt(
        self, function: str, *args: Any, symbol: str | None = None, quiet: tuple[int, ...] = ()
    ) -> tuple[Any, int]:
        raise NotImplementedError

    def _count_error(self, symbol: str, code: int) -> None:
        raise NotImplementedError

    def _board(self, index: int, function: str, *args: Any) -> tuple[Any, int]:
        """``_attempt`` for a board property: after NOT_SUPPORTED, never asked again."""
        if (index, function) in self._health.unsupported:
            return None, NVML_ERROR_NOT_SUPPORTED
        value, code = self._attempt(function, *args)
        if code == NVML_ERROR_NOT_SUPPORTED:
            self._health.unsupported.add((index, function))
        return value, code

    def _read_health(self, index: int, handle: Any, reading: DeviceReading) -> None:
        nv = self._nv
        sm, _ = self._board(index, "nvmlDeviceGetClockInfo", handle, nv.NVML_CLOCK_SM)
        reading.clock_sm_hertz = None if sm is None else float(sm * MHZ)
        mem, _ = self._board(index, "nvmlDeviceGetClockInfo", handle, nv.NVML_CLOCK_MEM)
        reading.clock_memory_hertz = None if mem is None else float(mem * MHZ)
        energy, _ = self._board(index, "nvmlDeviceGetTotalEnergyConsumption", handle)  # mJ
        reading.energy_joules = None if energy is None else energy / 1000.0
        fan, _ = self._board(index, "nvmlDeviceGetFanSpeed", handle)  # percent
        reading.fan_ratio = None if fan is None else min(int(fan), 100) / 100.0
        reading.encoder_ratio = self._codec(index, "nvmlDeviceGetEncoderUtilization", handle)
        reading.decoder_ratio = self._codec(index, "nvmlDeviceGetDecoderUtilization", handle)
        reading.throttle_reasons = self._throttle(index, handle)
        reading.memory_temperature_celsius = self._memory_temperature(index, handle)
        replay, _ = self._board(index, "nvmlDeviceGetPcieReplayCounter", handle)
        reading.pcie_replay_errors = None if replay is None else int(replay)
        self._read_ecc(index, handle, reading)
        self._read_retirement(index, handle, reading)
        self._read_xid(index, handle, reading)

    def _codec(self, index: int, function: str, handle: Any) -> float | None:
        value, _ = self._board(index, function, handle)  # [percent, sampling period µs]
        return None if value is None else min(int(value[0]), 100) / 100.0

    def _throttle(self, index: int, handle: Any) -> list[str] | None:
        # R535 renamed "throttle reasons" to "clocks event reasons"; older drivers have
        # only the old name.
        mask, code = self._board(index, "nvmlDeviceGetCurrentClocksEventReasons", handle)
        if code == NVML_ERROR_FUNCTION_NOT_FOUND:
            mask, _ = self._board(index, "nvmlDeviceGetCurrentClocksThrottleReasons", handle)
        if mask is None:
            return None
        return [name for name, bit in THROTTLE_REASONS if int(mask) & bit]

    def _memory_temperature(self, index: int, handle: Any) -> float | None:
        """HBM temperature: a field value (nvidia-smi "Memory Current Temp")."""
        symbol = "nvmlDeviceGetFieldValues(NVML_FI_DEV_MEMORY_TEMP)"
        if (index, symbol) in self._health.unsupported:
            return None
        nv = self._nv
        values, _ = self._attempt("nvmlDeviceGetFieldValues", handle, [nv.NVML_FI_DEV_MEMORY_TEMP])
        if values is None:
            return None
        value = values[0]
        if value.nvmlReturn != 0:  # this field's own answer
            self._count_error(symbol, int(value.nvmlReturn))
            if value.nvmlReturn == NVML_ERROR_NOT_SUPPORTED:
                self._health.unsupported.add((index, symbol))
            return None
        if value.valueType == nv.NVML_VALUE_TYPE_DOUBLE:
            return float(value.value.dVal)
        if value.valueType == nv.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG:
            return float(value.value.ullVal)
        return float(value.value.uiVal)

    def _read_ecc(self, index: int, handle: Any, reading: DeviceReading) -> None:
        nv = self._nv
        for attribute, error_type, counter in (
            ("ecc_uncorrected_volatile", nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC),
            ("ecc_uncorrected_aggregate", nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_AGGREGATE_ECC),
            ("ecc_corrected_volatile", nv.NVML_MEMORY_ERROR_TYPE_CORRECTED, nv.NVML_VOLATILE_ECC),
            ("ecc_corrected_aggregate", nv.NVML_MEMORY_ERROR_TYPE_CORRECTED, nv.NVML_AGGREGATE_ECC),
        ):  # fmt: skip
            count, _ = self._board(
                index, "nvmlDeviceGetTotalEccErrors", handle, error_type, counter
            )
            # Drivers answer the all-ones sentinel (2**64 - 1) for "not counted": past
            # what a counter can honestly reach (and a BIGINT holds), so unknown.
            known = count is not None and 0 <= int(count) < _COUNT_LIMIT
            setattr(reading, attribute, int(count) if known else None)

    def _read_retirement(self, index: int, handle: Any, reading: DeviceReading) -> None:
        nv = self._nv
        for attribute, cause in (
            ("retired_pages_single_bit", nv.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS),
            ("retired_pages_double_bit", nv.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR),
        ):  # fmt: skip
            pages, _ = self._board(index, "nvmlDeviceGetRetiredPages", handle, cause)
            setattr(reading, attribute, None if pages is None else len(pages))
        pending, _ = self._board(index, "nvmlDeviceGetRetiredPagesPendingStatus", handle)
        reading.retired_pages_pending = None if pending is None else bool(pending)
        rows, _ = self._board(index, "nvmlDeviceGetRemappedRows", handle)
        if rows is not None:
            corrected, uncorrected, is_pending, failed = rows
            reading.remapped_rows_correctable = int(corrected)
            reading.remapped_rows_uncorrectable = int(uncorrected)
            reading.remapped_rows_pending = bool(is_pending)
            reading.remapped_rows_failure = bool(failed)

    def _read_xid(self, index: int, handle: Any, reading: DeviceReading) -> None:
        if index not in self._health.xid:
            self._health.xid[index] = self._watch_xid(index, handle)
        watch = self._health.xid[index]
        if watch is None:
            return
        kind = self._nv.nvmlEventTypeXidCriticalError
        for _ in range(MAX_EVENTS_PER_POLL):
            event, _ = self._attempt(
                "nvmlEventSetWait_v2", watch.event_set, 0, quiet=(NVML_ERROR_TIMEOUT,)
            )
            if event is None:  # TIMEOUT: nothing (more) to deliver
                break
            if event.eventType & kind:
                watch.count += 1
                watch.last_code = int(event.eventData)
        reading.xid_errors = watch.count
        reading.xid_last_code = watch.last_code

    def _watch_xid(self, index: int, handle: Any) -> XidWatch | None:
        event_set, _ = self._attempt("nvmlEventSetCreate")
        if event_set is None:
            return None
        kind = self._nv.nvmlEventTypeXidCriticalError
        _, code = self._attempt("nvmlDeviceRegisterEvents", handle, kind, event_set)
        if code != 0:
            self._free_event_set(event_set)
            log.info("GPU %d cannot deliver Xid events; Xid counts are unavailable", index)
            return None
        return XidWatch(event_set)

    def _free_event_set(self, event_set: Any) -> None:
        self._attempt("nvmlEventSetFree", event_set)

    def _close_health(self) -> None:
        for watch in self._health.xid.values():
            if watch is not None:
                self._free_event_set(watch.event_set)
        self._health.xid.clear()
