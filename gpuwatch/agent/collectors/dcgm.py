"""dcgm-exporter compatible metrics, so NVIDIA's dcgm-exporter dashboard and existing DCGM queries keep working.

Names, units and labels follow dcgm-exporter's default counters (up to 4.8): MiB for
memory, MHz for clocks, percent for utilisation, W, mJ and °C; labels ``gpu``, ``UUID``
(with the ``GPU-`` prefix), ``pci_bus_id``, ``device``, ``modelName``, ``Hostname`` and
``DCGM_FI_DRIVER_VERSION``. A GPU in MIG mode has no series of its own, as in
dcgm-exporter: each MIG instance gets the set, with ``GPU_I_ID`` and ``GPU_I_PROFILE``,
its own framebuffer figures and its GPU's device-wide ones (temperature, power,
clocks). The profiling fields (``DCGM_FI_PROF_*``) come from NVML's GPU Performance
Monitoring on Hopper and later, per GPU and per MIG instance (each instance its own);
they are absent on older GPUs and on the agent's first poll: docs/dcgm.md says which.
Off by default (``--dcgm-compat`` /
``GPUWATCH_AGENT_DCGM_COMPAT``); the native ``gpuwatch_gpu_*`` metrics, in base units,
are the ones to build new dashboards on.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client.metrics_core import GaugeMetricFamily, Metric

from gpuwatch.metricspec import MetricSpec
from gpuwatch.snapshot import Gpu, HostSnapshot, MigInstance, Profiling

_L = ("gpu", "UUID", "pci_bus_id", "device", "modelName", "GPU_I_PROFILE", "GPU_I_ID",
      "Hostname", "DCGM_FI_DRIVER_VERSION")  # fmt: skip
_XID_L = (*_L, "err_code", "err_msg")
_MIB = 2**20
_MHZ = 1e6
_OPT_IN = "opt-in: dcgm_compat; GPU_I_* on MIG instances only"
_GPM = _OPT_IN + "; GPM (Hopper and later), from the agent's second poll"
# Xid texts as dcgm-exporter labels them (internal/pkg/collector/xid_errors.go, Apache-2.0,
# after NVIDIA's Xid catalog), for the codes seen most; others read "Unknown Error" here.
XID_TEXT = {
    0: "No Error", 8: "GPU stopped processing", 13: "Graphics Engine Exception",
    31: "GPU memory page fault", 32: "Invalid or corrupted push buffer stream",
    38: "Driver firmware error", 43: "GPU stopped processing",
    44: "Graphics Engine fault during context switch",
    45: "Preemptive cleanup, due to previous errors -- Most likely to see when running multiple cuda",
    48: "Double Bit ECC Error", 61: "Internal micro-controller breakpoint/warning",
    62: "Internal micro-controller halt", 63: "ECC page retirement or row remapping recording event",
    64: "ECC page retirement or row remapper recording failure", 68: "NVDEC0 Exception",
    69: "Graphics Engine class error", 74: "NVLINK Error", 79: "GPU has fallen off the bus",
    92: "High single-bit ECC error rate", 94: "Contained ECC error", 95: "Uncontained ECC error",
    109: "Context Switch Timeout Error", 119: "GSP RPC Timeout", 120: "GSP Error",
    121: "C2C Link Error", 140: "Unrecovered ECC Error", 143: "GPU Initialization Failure",
    149: "NVLINK: NETIR Error", 154: "GPU Recovery Action Changed",
}  # fmt: skip


def _spec(name: str, help: str) -> MetricSpec:
    # dcgm-exporter types some of these "counter" but names them without `_total`;
    # they are gauges here so the names stay exactly dcgm-exporter's.
    return MetricSpec(name, "gauge", help, _L, _OPT_IN)


GPU_TEMP = _spec("DCGM_FI_DEV_GPU_TEMP", "GPU temperature (in C).")
MEMORY_TEMP = _spec("DCGM_FI_DEV_MEMORY_TEMP", "Memory temperature (in C).")
POWER = _spec("DCGM_FI_DEV_POWER_USAGE", "Power draw (in W).")
ENERGY = _spec(
    "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "Total energy consumption since boot (in mJ)."
)
SM_CLOCK = _spec("DCGM_FI_DEV_SM_CLOCK", "SM clock frequency (in MHz).")
MEM_CLOCK = _spec("DCGM_FI_DEV_MEM_CLOCK", "Memory clock frequency (in MHz).")
GPU_UTIL = _spec("DCGM_FI_DEV_GPU_UTIL", "GPU utilization (in %).")
MEM_COPY_UTIL = _spec("DCGM_FI_DEV_MEM_COPY_UTIL", "Memory utilization (in %).")
ENC_UTIL = _spec("DCGM_FI_DEV_ENC_UTIL", "Encoder utilization (in %).")
DEC_UTIL = _spec("DCGM_FI_DEV_DEC_UTIL", "Decoder utilization (in %).")
FAN_SPEED = _spec("DCGM_FI_DEV_FAN_SPEED", "Fan speed (in %).")
FB_USED = _spec("DCGM_FI_DEV_FB_USED", "Framebuffer memory used (in MiB).")
FB_FREE = _spec("DCGM_FI_DEV_FB_FREE", "Framebuffer memory free (in MiB).")
FB_RESERVED = _spec("DCGM_FI_DEV_FB_RESERVED", "Framebuffer memory reserved (in MiB).")
FB_TOTAL = _spec("DCGM_FI_DEV_FB_TOTAL", "Framebuffer memory total (in MiB).")
XID = MetricSpec(
    "DCGM_FI_DEV_XID_ERRORS", "gauge", "Value of the last XID error encountered.", _XID_L,
    _OPT_IN + "; drivers that deliver Xid events",
)  # fmt: skip
PCIE_REPLAY = _spec("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", "Total number of PCIe retries.")
ROWS_CORRECTABLE = _spec(
    "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS", "Number of remapped rows for correctable errors"
)
ROWS_UNCORRECTABLE = _spec(
    "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", "Number of remapped rows for uncorrectable errors"
)
ROW_REMAP_FAILURE = _spec("DCGM_FI_DEV_ROW_REMAP_FAILURE", "Whether remapping of rows has failed")
ECC_SBE_VOL = _spec(
    "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", "Total number of single-bit volatile ECC errors."
)
ECC_DBE_VOL = _spec(
    "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "Total number of double-bit volatile ECC errors."
)
ECC_SBE_AGG = _spec(
    "DCGM_FI_DEV_ECC_SBE_AGG_TOTAL", "Total number of single-bit persistent ECC errors."
)
ECC_DBE_AGG = _spec(
    "DCGM_FI_DEV_ECC_DBE_AGG_TOTAL", "Total number of double-bit persistent ECC errors."
)
RETIRED_SBE = _spec(
    "DCGM_FI_DEV_RETIRED_SBE", "Total number of retired pages due to single-bit errors."
)
RETIRED_DBE = _spec(
    "DCGM_FI_DEV_RETIRED_DBE", "Total number of retired pages due to double-bit errors."
)
RETIRED_PENDING = _spec("DCGM_FI_DEV_RETIRED_PENDING", "Total number of pages pending retirement.")


def _prof(name: str, help: str) -> MetricSpec:
    return MetricSpec(name, "gauge", help, _L, _GPM)


# dcgm-exporter's help texts; ratios 0-1 and bytes/s, as DCGM reports them.
GR_ENGINE_ACTIVE = _prof(
    "DCGM_FI_PROF_GR_ENGINE_ACTIVE", "Ratio of time the graphics engine is active."
)
SM_ACTIVE = _prof(
    "DCGM_FI_PROF_SM_ACTIVE", "The ratio of cycles an SM has at least 1 warp assigned."
)
SM_OCCUPANCY = _prof("DCGM_FI_PROF_SM_OCCUPANCY", "The ratio of number of warps resident on an SM.")
TENSOR_ACTIVE = _prof(
    "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", "Ratio of cycles the tensor (HMMA) pipe is active."
)
TENSOR_DFMA = _prof(
    "DCGM_FI_PROF_PIPE_TENSOR_DFMA_ACTIVE", "Ratio of cycles the tensor (DFMA) pipe is active."
)
TENSOR_HMMA = _prof(
    "DCGM_FI_PROF_PIPE_TENSOR_HMMA_ACTIVE", "Ratio of cycles the tensor (HMMA) pipe is active."
)
TENSOR_IMMA = _prof(
    "DCGM_FI_PROF_PIPE_TENSOR_IMMA_ACTIVE", "Ratio of cycles the tensor (IMMA) pipe is active."
)
DRAM_ACTIVE = _prof(
    "DCGM_FI_PROF_DRAM_ACTIVE",
    "Ratio of cycles the device memory interface is active sending or receiving data.",
)
FP64_ACTIVE = _prof("DCGM_FI_PROF_PIPE_FP64_ACTIVE", "Ratio of cycles the fp64 pipes are active.")
FP32_ACTIVE = _prof("DCGM_FI_PROF_PIPE_FP32_ACTIVE", "Ratio of cycles the fp32 pipes are active.")
FP16_ACTIVE = _prof("DCGM_FI_PROF_PIPE_FP16_ACTIVE", "Ratio of cycles the fp16 pipes are active.")
PCIE_TX = _prof(
    "DCGM_FI_PROF_PCIE_TX_BYTES",
    "The rate of data transmitted over the PCIe bus - including both protocol headers and data payloads - in bytes per second.",
)
PCIE_RX = _prof(
    "DCGM_FI_PROF_PCIE_RX_BYTES",
    "The rate of data received over the PCIe bus - including both protocol headers and data payloads - in bytes per second.",
)
# Each PROF field and the Profiling field (GPM metric) it reads.
_PROFILING = (
    (GR_ENGINE_ACTIVE, "graphics_ratio"), (SM_ACTIVE, "sm_active_ratio"),
    (SM_OCCUPANCY, "sm_occupancy_ratio"), (TENSOR_ACTIVE, "tensor_ratio"),
    (TENSOR_DFMA, "tensor_dfma_ratio"), (TENSOR_HMMA, "tensor_hmma_ratio"),
    (TENSOR_IMMA, "tensor_imma_ratio"), (DRAM_ACTIVE, "dram_ratio"),
    (FP64_ACTIVE, "fp64_ratio"), (FP32_ACTIVE, "fp32_ratio"), (FP16_ACTIVE, "fp16_ratio"),
    (PCIE_TX, "pcie_tx_bytes_per_second"), (PCIE_RX, "pcie_rx_bytes_per_second"),
)  # fmt: skip

METRICS = (
    GPU_TEMP, MEMORY_TEMP, POWER, ENERGY, SM_CLOCK, MEM_CLOCK, GPU_UTIL, MEM_COPY_UTIL,
    ENC_UTIL, DEC_UTIL, FAN_SPEED, FB_USED, FB_FREE, FB_RESERVED, FB_TOTAL, XID, PCIE_REPLAY,
    ROWS_CORRECTABLE, ROWS_UNCORRECTABLE, ROW_REMAP_FAILURE, ECC_SBE_VOL, ECC_DBE_VOL,
    ECC_SBE_AGG, ECC_DBE_AGG, RETIRED_SBE, RETIRED_DBE, RETIRED_PENDING,
    *(spec for spec, _ in _PROFILING),
)  # fmt: skip


def _scaled(value: float | None, unit: float) -> float | None:
    return None if value is None else value / unit


def _percent(ratio: float | None) -> float | None:
    return None if ratio is None else round(ratio * 100)


def _flag(value: bool | None) -> float | None:
    return None if value is None else float(value)


def _device_values(gpu: Gpu) -> list[tuple[MetricSpec, float | None]]:
    """Device-wide fields: the same on every MIG instance of the GPU."""
    return [
        (GPU_TEMP, gpu.temperature_celsius),
        (MEMORY_TEMP, gpu.memory_temperature_celsius),
        (POWER, gpu.power_watts),
        (ENERGY, None if gpu.energy_joules is None else round(gpu.energy_joules * 1000)),
        (SM_CLOCK, _scaled(gpu.clock_sm_hertz, _MHZ)),
        (MEM_CLOCK, _scaled(gpu.clock_memory_hertz, _MHZ)),
        (GPU_UTIL, _percent(gpu.utilization_ratio)),
        (MEM_COPY_UTIL, _percent(gpu.memory_busy_ratio)),
        (ENC_UTIL, _percent(gpu.encoder_ratio)),
        (DEC_UTIL, _percent(gpu.decoder_ratio)),
        (FAN_SPEED, _percent(gpu.fan_ratio)),
        (PCIE_REPLAY, gpu.pcie_replay_errors),
        (ROWS_CORRECTABLE, gpu.remapped_rows_correctable),
        (ROWS_UNCORRECTABLE, gpu.remapped_rows_uncorrectable),
        (ROW_REMAP_FAILURE, _flag(gpu.remapped_rows_failure)),
        # DCGM's single/double-bit names are NVML's corrected/uncorrected counts.
        (ECC_SBE_VOL, gpu.ecc_corrected_volatile),
        (ECC_DBE_VOL, gpu.ecc_uncorrected_volatile),
        (ECC_SBE_AGG, gpu.ecc_corrected_aggregate),
        (ECC_DBE_AGG, gpu.ecc_uncorrected_aggregate),
        (RETIRED_SBE, gpu.retired_pages_single_bit),
        (RETIRED_DBE, gpu.retired_pages_double_bit),
        (RETIRED_PENDING, _flag(gpu.retired_pages_pending)),
    ]


def _gpu_memory(gpu: Gpu) -> list[tuple[MetricSpec, float | None]]:
    return [
        (FB_USED, _mib(gpu.memory_used_bytes)),
        (FB_FREE, _mib(gpu.memory_free_bytes)),
        (FB_RESERVED, _mib(gpu.memory_reserved_bytes)),
        (FB_TOTAL, _mib(gpu.memory_total_bytes)),
    ]


def _profiling(profiling: Profiling | None) -> list[tuple[MetricSpec, float | None]]:
    """The entity's own GPM figures (a MIG instance's are its own, not its GPU's)."""
    if profiling is None:
        return []
    return [(spec, getattr(profiling, name)) for spec, name in _PROFILING]


def _mig_memory(mig: MigInstance) -> list[tuple[MetricSpec, float | None]]:
    total, used = mig.memory_total_bytes, mig.memory_used_bytes
    free = None if total is None or used is None else max(0, total - used)
    return [
        (FB_USED, _mib(used)),
        (FB_FREE, _mib(free)),
        (FB_TOTAL, _mib(total)),
    ]


def _mib(value: int | None) -> float | None:
    return None if value is None else value // _MIB


class DcgmCompatCollector:
    name = "dcgm"

    def __init__(self, source: Callable[[], HostSnapshot | None]) -> None:
        self._source = source

    def collect(self) -> Iterable[Metric]:
        snapshot = self._source()
        if snapshot is None:
            return []
        families = {spec.name: GaugeMetricFamily(spec.name, spec.help) for spec in METRICS}
        for gpu in snapshot.gpus:
            if gpu.lost or gpu.read_error:
                continue
            base = {
                "gpu": str(gpu.index), "UUID": gpu.uuid, "pci_bus_id": gpu.pci_bus_id or "",
                "device": f"nvidia{gpu.index}", "modelName": gpu.name or "",
            }  # fmt: skip
            tail = {
                "Hostname": snapshot.hostname,
                "DCGM_FI_DRIVER_VERSION": snapshot.driver_version or "",
            }
            entities: list[tuple[dict[str, str], list[tuple[MetricSpec, float | None]]]] = []
            if gpu.mig_instances:
                for mig in gpu.mig_instances:
                    instance = {
                        "GPU_I_PROFILE": mig.profile or "",
                        "GPU_I_ID": "" if mig.gpu_instance_id is None else str(mig.gpu_instance_id),
                    }
                    own = _mig_memory(mig) + _profiling(mig.profiling)
                    entities.append(({**base, **instance, **tail}, own))
            else:
                entities.append(({**base, **tail}, _gpu_memory(gpu) + _profiling(gpu.profiling)))
            for labels, memory in entities:
                for spec, value in _device_values(gpu) + memory:
                    if value is not None:
                        families[spec.name].add_sample(spec.name, labels, value)
                if gpu.xid_errors is not None:  # the Xid watch works: 0 until the first one
                    code = gpu.xid_last_code or 0
                    text = XID_TEXT.get(code, "Unknown Error")
                    xid_labels = {**labels, "err_code": str(code), "err_msg": text}
                    families[XID.name].add_sample(XID.name, xid_labels, code)
        return [family for family in families.values() if family.samples]
