"""Per-GPU health metrics: clocks, energy, fans, throttling, ECC, retirement, Xid.

Rendered by :class:`~gpuwatch.agent.collectors.gpu.GpuCollector` (one series set per
GPU, labels ``gpu`` and ``uuid``); declared here so each family says where NVML gets it.
A field the board does not report is absent, never 0. Counters that the board does
report start at their current value on the first scrape, so ``increase()`` sees every
later error; 0/1 gauges are exported for every known reason, so an alert can tell
"not throttled" from "not known".
"""

from __future__ import annotations

from typing import get_args

from gpuwatch.metricspec import Families, MetricSpec
from gpuwatch.snapshot import Gpu, ThrottleReason

_L = ("gpu", "uuid")
THROTTLE_REASONS: tuple[str, ...] = get_args(ThrottleReason)

# Absent while the GPU is lost or its read timed out, and where NVML has no answer.
_READ = "while the GPU is read (gpuwatch_gpu_up 1) and NVML reports it"

MEMORY_TEMPERATURE = MetricSpec(
    "gpuwatch_gpu_memory_temperature_celsius", "gauge",
    "HBM temperature (nvidia-smi: Memory Current Temp).", _L,
    "boards with an HBM temperature sensor",
)  # fmt: skip
ENERGY = MetricSpec(
    "gpuwatch_gpu_energy_joules", "counter",
    "Energy the GPU used since the driver loaded (nvmlDeviceGetTotalEnergyConsumption).", _L,
    "Volta and later",
)  # fmt: skip
CLOCK = MetricSpec(
    "gpuwatch_gpu_clock_hertz", "gauge",
    "Current clock, by clock (sm, memory): nvidia-smi clocks.sm, clocks.mem.", ("gpu", "uuid", "clock"),
    _READ,
)  # fmt: skip
FAN = MetricSpec(
    "gpuwatch_gpu_fan_ratio", "gauge", "Speed of the first fan as a fraction of its maximum (0-1).",
    _L, "boards with fans (not passively cooled modules)",
)  # fmt: skip
ENCODER = MetricSpec(
    "gpuwatch_gpu_encoder_utilization_ratio", "gauge",
    "Fraction of the last sample period the video encoder was busy (0-1).", _L, _READ,
)  # fmt: skip
DECODER = MetricSpec(
    "gpuwatch_gpu_decoder_utilization_ratio", "gauge",
    "Fraction of the last sample period the video decoder was busy (0-1).", _L, _READ,
)  # fmt: skip
THROTTLE = MetricSpec(
    "gpuwatch_gpu_throttle_reasons", "gauge",
    "1 while this reason holds the clocks down, else 0 (nvidia-smi -q: Clocks Event Reasons). "
    f"Reasons: {', '.join(THROTTLE_REASONS)}. sw_power_cap is normal at full load.",
    ("gpu", "uuid", "reason"), _READ,
)  # fmt: skip
ECC = MetricSpec(
    "gpuwatch_gpu_ecc_errors", "counter",
    "ECC memory errors by type (corrected, uncorrected) and counter (volatile: since the "
    "driver loaded; aggregate: the board's lifetime). Do not sum across counter.",
    ("gpu", "uuid", "type", "counter"), "ECC enabled",
)  # fmt: skip
RETIRED = MetricSpec(
    "gpuwatch_gpu_retired_pages", "gauge",
    "Memory pages retired, by cause (single_bit: repeated corrected errors; double_bit).",
    ("gpu", "uuid", "cause"), "before Ampere (later boards remap rows)",
)  # fmt: skip
RETIRED_PENDING = MetricSpec(
    "gpuwatch_gpu_retired_pages_pending", "gauge",
    "1 when a page waits to be retired at the next driver reload or reset.", _L,
    "before Ampere",
)  # fmt: skip
REMAPPED = MetricSpec(
    "gpuwatch_gpu_remapped_rows", "gauge",
    "Memory rows remapped, by the errors that caused it (correctable, uncorrectable).",
    ("gpu", "uuid", "cause"), "Ampere and later",
)  # fmt: skip
REMAP_PENDING = MetricSpec(
    "gpuwatch_gpu_row_remap_pending", "gauge",
    "1 when a row remap waits for a GPU reset to take effect.", _L, "Ampere and later",
)  # fmt: skip
REMAP_FAILURE = MetricSpec(
    "gpuwatch_gpu_row_remap_failure", "gauge",
    "1 when a row remap failed: the GPU needs service.", _L, "Ampere and later",
)  # fmt: skip
XID = MetricSpec(
    "gpuwatch_gpu_xid_errors", "counter",
    "Xid (critical error) events NVML delivered since the agent started watching.", _L,
    "drivers that deliver Xid events",
)  # fmt: skip
XID_LAST = MetricSpec(
    "gpuwatch_gpu_xid_last_code", "gauge", "Code of the last Xid event (see NVIDIA's Xid catalog).",
    _L, "after the first Xid event",
)  # fmt: skip
PCIE_REPLAYS = MetricSpec(
    "gpuwatch_gpu_pcie_replays", "counter",
    "PCIe packet replays (link retries) since the driver loaded.", _L, _READ,
)  # fmt: skip

METRICS = (
    MEMORY_TEMPERATURE, ENERGY, CLOCK, FAN, ENCODER, DECODER, THROTTLE, ECC, RETIRED,
    RETIRED_PENDING, REMAPPED, REMAP_PENDING, REMAP_FAILURE, XID, XID_LAST, PCIE_REPLAYS,
)  # fmt: skip


def _flag(value: bool | None) -> float | None:
    return None if value is None else float(value)


def add_health(f: Families, gpu: Gpu) -> None:
    """Add one readable GPU's health series (its labels: index and uuid)."""
    labels = (str(gpu.index), gpu.uuid)
    f.add(MEMORY_TEMPERATURE, labels, gpu.memory_temperature_celsius)
    f.add(ENERGY, labels, gpu.energy_joules)
    f.add(CLOCK, (*labels, "sm"), gpu.clock_sm_hertz)
    f.add(CLOCK, (*labels, "memory"), gpu.clock_memory_hertz)
    f.add(FAN, labels, gpu.fan_ratio)
    f.add(ENCODER, labels, gpu.encoder_ratio)
    f.add(DECODER, labels, gpu.decoder_ratio)
    if gpu.throttle_reasons is not None:
        for reason in THROTTLE_REASONS:
            f.add(THROTTLE, (*labels, reason), float(reason in gpu.throttle_reasons))
    for kind, counter, value in (
        ("uncorrected", "volatile", gpu.ecc_uncorrected_volatile),
        ("uncorrected", "aggregate", gpu.ecc_uncorrected_aggregate),
        ("corrected", "volatile", gpu.ecc_corrected_volatile),
        ("corrected", "aggregate", gpu.ecc_corrected_aggregate),
    ):
        f.add(ECC, (*labels, kind, counter), value)
    f.add(RETIRED, (*labels, "single_bit"), gpu.retired_pages_single_bit)
    f.add(RETIRED, (*labels, "double_bit"), gpu.retired_pages_double_bit)
    f.add(RETIRED_PENDING, labels, _flag(gpu.retired_pages_pending))
    f.add(REMAPPED, (*labels, "correctable"), gpu.remapped_rows_correctable)
    f.add(REMAPPED, (*labels, "uncorrectable"), gpu.remapped_rows_uncorrectable)
    f.add(REMAP_PENDING, labels, _flag(gpu.remapped_rows_pending))
    f.add(REMAP_FAILURE, labels, _flag(gpu.remapped_rows_failure))
    f.add(XID, labels, gpu.xid_errors)
    f.add(XID_LAST, labels, gpu.xid_last_code)
    f.add(PCIE_REPLAYS, labels, gpu.pcie_replay_errors)
