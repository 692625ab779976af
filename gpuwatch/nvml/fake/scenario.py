"""What a scenario file describes, once read and checked: GPUs, processes and faults.

These are plain frozen values; :mod:`gpuwatch.nvml.fake.scenario_file` builds them from
TOML, and :mod:`gpuwatch.nvml.fake.host` evaluates them at a point in time. Sizes are
bytes, times scenario seconds, percentages 0..100 (as NVML reports them).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from gpuwatch.nvml.fake.timeline import Timeline

FaultKind = Literal[
    "gpu_lost",
    "hang",
    # The named functions answer this NVML error (NVML_ERROR_<KIND>).
    "unsupported",
    "no_permission",
    "unknown",
    "timeout",
    "function_not_found",
    "insufficient_power",
    "irq_issue",
    "reset_required",
    # nvmlInit answers this: the library cannot start at all.
    "driver_not_loaded",
    "lib_rm_version_mismatch",
]
# Kinds that fail nvmlInit (every version of it) rather than named functions.
INIT_FAULT_KINDS: tuple[FaultKind, ...] = ("driver_not_loaded", "lib_rm_version_mismatch")
INIT_FUNCTIONS = ("nvmlInit", "nvmlInitWithFlags")
# Which handles of a GPU a fault applies to: None, the GPU and its MIG instances;
# "parent", the GPU's own handle only; N, MIG instance N's handle only.
MigScope = int | Literal["parent"] | None
ProcessKind = Literal["compute", "graphics", "mps"]

# NVML's "not in MIG mode" marker for gpuInstanceId / computeInstanceId.
NO_MIG_INSTANCE = 0xFFFFFFFF

_VERSION_SUFFIX = re.compile(r"_v\d+$")


def symbol_family(symbol: str) -> str:
    """``"nvmlDeviceGetMemoryInfo_v2"`` -> ``"nvmlDeviceGetMemoryInfo"``: faults match all versions."""
    return _VERSION_SUFFIX.sub("", symbol)


@dataclass(frozen=True)
class MigSpec:
    """One MIG GPU instance (with one compute instance) carved out of a GPU."""

    index: int
    profile: str  # "3g.40gb", as in "NVIDIA A100-SXM4-80GB MIG 3g.40gb"
    uuid: str
    memory_total: int
    gpu_instance_id: int
    compute_instance_id: int
    # The instance's GR-engine activity (GPM's GRAPHICS_UTIL); None: derived from the
    # SM percentages of its processes.
    activity_percent: Timeline | None = None


@dataclass(frozen=True)
class HealthSpec:
    """What a GPU reports about its health (docs/scenarios.md, "Health").

    Count timelines never decrease. ``None`` for ``memory_temperature_celsius`` means the
    board has no such sensor (NOT_SUPPORTED); for ``throttle_reasons`` it means derived
    (``gpu_idle`` while the GPU is idle, nothing while busy).
    """

    memory_temperature_celsius: Timeline | None
    fans: int  # 0: passively cooled, fan calls answer NOT_SUPPORTED
    throttle_reasons: Timeline | None  # a bitmask of nvmlClocksEventReason* values
    ecc: bool  # ECC enabled; when off, error counts are NOT_SUPPORTED
    ecc_corrected: Timeline  # volatile counts; aggregate reads the same (no history)
    ecc_uncorrected: Timeline
    retired_pages_single_bit: Timeline  # page retirement: before Ampere only
    retired_pages_double_bit: Timeline
    retired_pages_pending: bool
    remapped_rows_correctable: Timeline  # row remapping: Ampere and later only
    remapped_rows_uncorrectable: Timeline
    remapped_rows_pending: bool
    remapped_rows_failure: bool
    pcie_replay: Timeline
    xid: tuple[tuple[float, int], ...]  # (scenario time, Xid code), in time order


@dataclass(frozen=True)
class GpuSpec:
    """One physical GPU. ``None`` timelines are derived from the processes (see docs)."""

    index: int
    name: str
    uuid: str
    pci_bus_id: str  # "00000000:01:00.0"
    pci_device_id: int
    memory_total: int
    memory_reserved: int
    unattributed: Timeline  # bytes used that no process accounts for
    power_limit_watts: float
    power_watts: Timeline | None
    temperature_celsius: Timeline | None
    utilization_percent: Timeline | None
    memory_busy_percent: Timeline | None
    fan_percent: Timeline
    clock_sm_mhz: int
    clock_memory_mhz: int
    bar1_total: int
    cuda_capability: tuple[int, int]
    coherent: bool  # Grace Hopper-like: addressing mode ATS, freed memory is not returned
    persistence_mode: bool
    display_active: bool
    mig: tuple[MigSpec, ...]
    health: HealthSpec
    # The board has MIG (A100, H100, ...); without it nvmlDeviceGetMigMode is NOT_SUPPORTED.
    mig_capable: bool = True
    # GPU Performance Monitoring (nvmlGpm*): Hopper and later; per MIG instance too.
    gpm: bool = False

    @property
    def remaps_rows(self) -> bool:
        """Ampere and later remap rows; older boards retire pages instead."""
        return self.cuda_capability[0] >= 8


@dataclass(frozen=True)
class Spawn:
    """A real stand-in process, started once per scenario, whose cmdline is ``argv``."""

    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...]
    orphan: bool  # started through a parent that exits, so it is reparented


@dataclass(frozen=True)
class Attach:
    """An existing process: a PID, or the process that boots the scenario ("self"), or its parent."""

    target: int | Literal["self", "parent"]


@dataclass(frozen=True)
class Ghost:
    """A PID that does not exist: memory held by a dead process, shown whatever its liveness."""

    pid: int


@dataclass(frozen=True)
class ProcessSpec:
    """One GPU context. ``entry``/``copy`` name it: the ``[[process]]`` table and its ``count`` copy."""

    entry: int
    copy: int
    gpu: int
    mig: int | None
    origin: Spawn | Attach | Ghost
    kind: ProcessKind
    memory: Timeline  # bytes, over process time
    sm_percent: Timeline
    memory_busy_percent: Timeline | None
    # Share of time its tensor pipes are busy (GPM's ANY_TENSOR_UTIL); like the hardware's,
    # meant to be at most sm_percent, but not checked.
    tensor_percent: Timeline
    # Share of time it keeps the video encoder / decoder busy (NVENC/NVDEC): work that
    # shows in no SM figure, so a transcoder with sm_percent 0 is still busy.
    encoder_percent: Timeline
    decoder_percent: Timeline
    start: float  # scenario seconds until the context appears
    exit: float | None  # scenario seconds at which it ends (the stand-in exits too)
    memory_not_available: bool  # report usedGpuMemory as NVML_VALUE_NOT_AVAILABLE

    @property
    def key(self) -> str:
        """Stable name in the runtime state file: ``"<entry>.<copy>"``."""
        return f"{self.entry}.{self.copy}"


@dataclass(frozen=True)
class FaultSpec:
    """A failure injected from ``at`` for ``duration`` scenario seconds (``None``: for ever)."""

    gpu: int | None  # None: every GPU
    kind: FaultKind
    functions: tuple[str, ...]  # C symbols or families; empty for gpu_lost
    at: float
    duration: float | None
    seconds: float  # hang only: real seconds each matching call sleeps
    mig: MigScope = None

    def active(self, t: float) -> bool:
        return self.at <= t and (self.duration is None or t < self.at + self.duration)

    def matches(self, symbol: str) -> bool:
        return symbol in self.functions or symbol_family(symbol) in self.functions

    def covers(self, gpu: int | None, mig: int | None) -> bool:
        """True for a call on GPU ``gpu`` through its own handle (``mig`` None) or
        through MIG instance ``mig``'s."""
        if self.gpu is not None and self.gpu != gpu:
            return False
        if self.mig is None:
            return True
        return mig is None if self.mig == "parent" else self.mig == mig


@dataclass(frozen=True)
class Scenario:
    """A whole fake host. ``content_hash`` (sha256 of the file) keys its runtime state."""

    name: str
    description: str
    source: Path
    content_hash: str
    speed: float  # scenario seconds per wall-clock second
    lifetime: float  # wall seconds after which stand-ins exit on their own
    driver_version: str
    nvml_version: str
    cuda_driver_version: int  # 12040 for CUDA 12.4, as nvmlSystemGetCudaDriverVersion
    gpus: tuple[GpuSpec, ...]
    processes: tuple[ProcessSpec, ...]
    faults: tuple[FaultSpec, ...]

    def processes_on(self, gpu: int) -> tuple[ProcessSpec, ...]:
        return tuple(p for p in self.processes if p.gpu == gpu)
