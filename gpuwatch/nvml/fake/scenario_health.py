"""Read a ``[[gpu]]`` table's health keys (ECC, throttling, Xid, ...) into a HealthSpec.

Every key is optional and documented in ``docs/scenarios.md`` ("Health"); the defaults
describe a healthy board. Count timelines (ECC errors, remapped rows, PCIe replays)
must never decrease, as the counters they stand for do not.
"""

from __future__ import annotations

from gpuwatch.nvml.fake import scenario_values as values
from gpuwatch.nvml.fake.scenario import HealthSpec
from gpuwatch.nvml.fake.scenario_values import Table
from gpuwatch.nvml.fake.timeline import (
    Constant,
    Linear,
    Sawtooth,
    Timeline,
    never_decreases,
    parse_timeline,
)
from gpuwatch.quantities import parse_seconds

# nvmlClocksEventReason* bits (nvml.h), by the names gpuwatch exports them under.
THROTTLE_BITS = {
    "gpu_idle": 0x1,
    "applications_clocks_setting": 0x2,
    "sw_power_cap": 0x4,
    "hw_slowdown": 0x8,
    "sync_boost": 0x10,
    "sw_thermal_slowdown": 0x20,
    "hw_thermal_slowdown": 0x40,
    "hw_power_brake_slowdown": 0x80,
    "display_clock_setting": 0x100,
}
MAX_XID_EVENTS = 1000
MAX_COUNT = 2**31


def read_health(table: Table) -> HealthSpec:
    """The health keys of one ``[[gpu]]`` table (the caller checks for unknown keys)."""
    fans = table.get("fans", values.index, 1)
    if fans > 32:
        raise table.error("fans", "at most 32 fans")
    return HealthSpec(
        memory_temperature_celsius=table.get(
            "memory_temperature_celsius", values.ranged_timeline(-100, 300), None
        ),
        fans=fans,
        throttle_reasons=table.get("throttle_reasons", _throttle_timeline, None),
        ecc=table.get("ecc", values.boolean, True),
        ecc_corrected=table.get("ecc_corrected", _count_timeline, Constant(0)),
        ecc_uncorrected=table.get("ecc_uncorrected", _count_timeline, Constant(0)),
        retired_pages_single_bit=table.get(
            "retired_pages_single_bit", _count_timeline, Constant(0)
        ),
        retired_pages_double_bit=table.get(
            "retired_pages_double_bit", _count_timeline, Constant(0)
        ),
        retired_pages_pending=table.get("retired_pages_pending", values.boolean, False),
        remapped_rows_correctable=table.get(
            "remapped_rows_correctable", _count_timeline, Constant(0)
        ),
        remapped_rows_uncorrectable=table.get(
            "remapped_rows_uncorrectable", _count_timeline, Constant(0)
        ),
        remapped_rows_pending=table.get("remapped_rows_pending", values.boolean, False),
        remapped_rows_failure=table.get("remapped_rows_failure", values.boolean, False),
        pcie_replay=table.get("pcie_replay", _count_timeline, Constant(0)),
        xid=table.get("xid", _xid_events, ()),
    )


def _count(value: object) -> float:
    number = values.index(value)
    if number > MAX_COUNT:
        raise ValueError(f"a count must be at most {MAX_COUNT}")
    return float(number)


def _count_timeline(value: object) -> Timeline:
    timeline = parse_timeline(value, _count)
    if not never_decreases(timeline):
        raise ValueError("a count never decreases: use a constant, a rising linear or rising steps")
    return timeline


def _reason_mask(value: object) -> float:
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ValueError('expected a list of reasons, e.g. ["sw_thermal_slowdown"]')
    mask = 0
    for name in names:
        if name not in THROTTLE_BITS:
            raise ValueError(f"unknown reason {name!r} (one of {', '.join(THROTTLE_BITS)})")
        mask |= THROTTLE_BITS[name]
    return float(mask)


def _throttle_timeline(value: object) -> Timeline:
    timeline = parse_timeline(value, _reason_mask)
    if isinstance(timeline, Linear | Sawtooth):
        raise ValueError("reasons are a list, or steps of lists; they do not ramp")
    return timeline


def _xid_events(value: object) -> tuple[tuple[float, int], ...]:
    if not isinstance(value, list) or len(value) > MAX_XID_EVENTS:
        raise ValueError(
            f'expected a list of [time, code] pairs (at most {MAX_XID_EVENTS}), e.g. [["2m", 79]]'
        )
    events: list[tuple[float, int]] = []
    for item in value:
        if not isinstance(item, list) or len(item) != 2:
            raise ValueError(f"each Xid event is a [time, code] pair, got {item!r}")
        code = values.index(item[1])
        if not 0 < code < 2**16:
            raise ValueError(f"an Xid code is 1..65535, got {code}")
        events.append((parse_seconds(item[0]), code))
    if [t for t, _ in events] != sorted(t for t, _ in events):
        raise ValueError("Xid events must be in time order")
    return tuple(events)
