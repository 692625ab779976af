"""The one module that talks to pynvml (nvidia-ml-py).

Everything above this layer gets plain Python values in base units and ``None`` for
"not available"; nothing above it imports pynvml or sees an ``NVMLError``.

Errors are translated here, in two classes:

* **fatal** (:class:`~gpuwatch.errors.NvmlUnavailable`): the library is missing, the
  driver is not loaded, or NVML refuses to initialise. The message says what to
  install or check.
* **per field**: ``NOT_SUPPORTED``, ``NO_PERMISSION``, ``NOT_FOUND``, a missing
  function, or any other error on one call make that field ``None`` (never 0) and are
  counted in :class:`NvmlErrorCounts` by function and error, except answers that only say
  "none here" every poll: an empty MIG slot (NOT_FOUND), and NOT_SUPPORTED for the
  utilization NVML has no figure for in MIG mode. ``GPU_IS_LOST`` marks the
  whole device lost; the other devices are read as usual. A device whose handle NVML
  will not give (NO_PERMISSION, UNKNOWN, INSUFFICIENT_POWER, ...) comes back with a
  ``read_error`` and its processes unlisted: nothing of it was read.

A MIG GPU's aggregate process lists and memory need privileges; when NVML refuses them
(NO_PERMISSION), they are read from each MIG instance's handle and combined, and the
parent is not asked again while the GPU stays in MIG mode.

Versioned functions are probed once per session: memory info v2 (which separates the
driver's reserved memory from "used") falls back to v1; running-process lists v3 fall
back to v2. A function the driver lacks is logged once, then skipped. Health readings
(clocks, energy, ECC, Xid, ...: :mod:`gpuwatch.nvml.health`) a board does not support
are asked once per device. Profiling figures of each GPU and MIG instance (engine, SM,
tensor, DRAM and PCIe activity; Hopper and later) come from GPM (:mod:`gpuwatch.nvml.gpm`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from types import ModuleType
from typing import Any, Literal, TypeVar

from gpuwatch.errors import NvmlUnavailable
from gpuwatch.nvml.gpm import GpmActivity, GpmReads, GpmState
from gpuwatch.nvml.health import HealthReads, HealthState
from gpuwatch.snapshot import UNKNOWN_GPU_UUID_PREFIX

log = logging.getLogger(__name__)

T = TypeVar("T")

# NVML return codes (nvml.h). Kept here so the rest of gpuwatch never needs pynvml.
_ERROR_NAMES = {
    1: "uninitialized",
    2: "invalid_argument",
    3: "not_supported",
    4: "no_permission",
    6: "not_found",
    7: "insufficient_size",
    8: "insufficient_power",
    9: "driver_not_loaded",
    10: "timeout",
    11: "irq_issue",
    12: "library_not_found",
    13: "function_not_found",
    14: "corrupted_inforom",
    15: "gpu_is_lost",
    16: "reset_required",
    17: "operating_system",
    18: "lib_rm_version_mismatch",
    19: "in_use",
    20: "memory",
    21: "no_data",
    23: "insufficient_resources",
    25: "argument_version_mismatch",
    28: "gpu_not_found",
    29: "invalid_state",
    999: "unknown",
}
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_NOT_SUPPORTED = 3
# Answers that mean "no such list here" (a GPU without graphics or MPS contexts, an
# older driver), not a failure to list: the list is then empty.
_NO_SUCH_LIST = frozenset({0, NVML_ERROR_NOT_SUPPORTED, NVML_ERROR_FUNCTION_NOT_FOUND})
# What NVML answers, in MIG mode, for the GPU-wide and per-process utilization it does
# not have there: documented absences, not errors to count.
_MIG_UNSUPPORTED = (NVML_ERROR_NOT_SUPPORTED,)
# gpuInstanceId of a process on a GPU not in MIG mode (0xFFFFFFFF in nvml.h).
_NO_INSTANCE = 0xFFFFFFFF
# What nvmlDeviceGetMemoryInfo_v2 answers on a driver without it: missing symbol, the
# struct version refused, or not supported on this board.
_MEMORY_V2_ABSENT = frozenset({NVML_ERROR_FUNCTION_NOT_FOUND, 2, 3, 25})
# How often the driver records a per-process utilisation sample (about once a second;
# the fake GPUs do the same). A read sooner than this after the previous one usually
# finds no new sample, and that silence says nothing about activity.
PROCESS_SAMPLE_PERIOD_SECONDS = 1.0
# A newest sample stamped this far past the wall clock means the clock stepped back.
CLOCK_STEP_SECONDS = 5.0


def error_name(code: int) -> str:
    """Short, label-safe name of an NVML return code (``3`` -> ``"not_supported"``)."""
    return _ERROR_NAMES.get(code, f"code_{code}")


def _fatal_message(code: int) -> str:
    if code == 12:
        return (
            "NVIDIA's NVML library (libnvidia-ml.so.1) was not found: install the NVIDIA "
            "driver, or run with --fake-gpus SCENARIO to simulate GPUs"
        )
    if code == 9:
        return (
            "the NVIDIA kernel driver is not loaded (check `lsmod | grep nvidia` and "
            "`dmesg | grep -i nvidia`), or use --fake-gpus SCENARIO"
        )
    if code == 4:
        return "no permission to talk to the NVIDIA driver (check access to /dev/nvidia*)"
    if code == 18:
        return "the NVML library and the loaded kernel driver differ in version: reboot or reload the driver"
    return f"NVML failed to initialise: {error_name(code)}"


class GpuLost(Exception):
    """Internal: the device reported GPU_IS_LOST ("fallen off the bus")."""


@dataclass
class NvmlErrorCounts:
    """Thread-safe counts of per-field NVML failures, by (function, error name)."""

    _counts: Counter[tuple[str, str]] = field(default_factory=Counter)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, function: str, error: str) -> None:
        with self._lock:
            self._counts[(function, error)] += 1

    def snapshot(self) -> dict[tuple[str, str], int]:
        with self._lock:
            return dict(self._counts)


@dataclass(frozen=True)
class ProcessUsage:
    """One row of ``nvidia-smi --query-compute-apps``: a host PID and its GPU memory."""

    pid: int
    kind: Literal["compute", "graphics", "mps"]
    used_bytes: int | None
    gpu_instance_id: int | None = None  # the MIG GPU instance it runs in; None off MIG


@dataclass
class MigReading:
    index: int
    uuid: str
    name: str | None
    memory_total_bytes: int | None
    memory_used_bytes: int | None
    gpu_instance_id: int | None = None
    profile: str | None = None  # "3g.40gb"
    # Every GPM figure since the previous poll; None: no GPM, or no pair yet.
    gpm: GpmActivity | None = None

    @property
    def activity_ratio(self) -> float | None:
        """Busy share since the previous poll: GPM's graphics activity rounded to a whole
        percent, like NVML's other utilisations (see :mod:`gpuwatch.nvml.gpm`); None:
        not measurable."""
        graphics = None if self.gpm is None else self.gpm.graphics_ratio
        return None if graphics is None else round(graphics * 100) / 100


@dataclass
class DeviceReading:
    """What one poll read from one GPU. ``None`` fields were not available."""

    index: int
    uuid: str
    name: str | None = None
    pci_bus_id: str | None = None
    lost: bool = False
    memory_total_bytes: int | None = None
    memory_used_bytes: int | None = None
    memory_free_bytes: int | None = None
    memory_reserved_bytes: int | None = None
    # True when "used" came from memory info v1 (a driver before R510, a vGPU guest that
    # refuses v2): it then includes the driver's reserved memory, which no process holds
    # and no figure separates, so "used less what processes hold" is not unattributed.
    memory_used_includes_reserved: bool = False
    utilization_ratio: float | None = None
    memory_busy_ratio: float | None = None
    temperature_celsius: float | None = None
    power_watts: float | None = None
    power_limit_watts: float | None = None
    # Health (gpuwatch.nvml.health), in base units; None where the board does not say.
    memory_temperature_celsius: float | None = None
    energy_joules: float | None = None
    clock_sm_hertz: float | None = None
    clock_memory_hertz: float | None = None
    fan_ratio: float | None = None
    encoder_ratio: float | None = None
    decoder_ratio: float | None = None
    throttle_reasons: list[str] | None = None
    ecc_uncorrected_volatile: int | None = None
    ecc_uncorrected_aggregate: int | None = None
    ecc_corrected_volatile: int | None = None
    ecc_corrected_aggregate: int | None = None
    retired_pages_single_bit: int | None = None
    retired_pages_double_bit: int | None = None
    retired_pages_pending: bool | None = None
    remapped_rows_correctable: int | None = None
    remapped_rows_uncorrectable: int | None = None
    remapped_rows_pending: bool | None = None
    remapped_rows_failure: bool | None = None
    xid_errors: int | None = None
    xid_last_code: int | None = None
    pcie_replay_errors: int | None = None
    # True on ATS-addressed (cache-coherent, Grace Hopper style) GPUs; None when the
    # driver cannot say (nvmlDeviceGetAddressingMode needs R570 or newer).
    coherent_memory: bool | None = None
    # Set when NVML would not give this GPU's handle (``"no handle: unknown"``): nothing
    # was read, so nothing is known of its processes (``processes_unlisted`` too).
    read_error: str | None = None
    processes: list[ProcessUsage] = field(default_factory=list)
    # True when NVML failed to list this GPU's processes (UNKNOWN, TIMEOUT, ...):
    # ``processes`` is then what it could list, not all there are.
    processes_unlisted: bool = False
    # The process list read just before the memory figures (``processes`` is read just
    # after them), so a reader can tell whether the two describe the same moment.
    processes_before_memory: list[ProcessUsage] | None = None
    # pid -> busy ratio of its busiest engine (SM, encoder, decoder) since the previous
    # poll; None when the call itself failed. See NvmlSession._read_process_sm.
    process_sm: dict[int, float] | None = None
    mig: list[MigReading] = field(default_factory=list)
    # GPM figures of the whole GPU since the previous poll; None: no GPM, or no pair yet.
    gpm: GpmActivity | None = None


def unknown_uuid(index: int) -> str:
    """The placeholder UUID of GPU ``index`` whose UUID NVML would not give."""
    return f"{UNKNOWN_GPU_UUID_PREFIX}{index}"


def _to_str(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


class NvmlSession(HealthReads, GpmReads):
    """An initialised NVML, and typed reads of each device.

    Open with :meth:`open`, close with :meth:`close` (or use as a context manager).
    ``module`` is the pynvml module; the fake GPUs install themselves beneath it
    (as ``pynvml.nvmlLib``), so this class never knows whether a GPU is real.
    """

    def __init__(self, module: ModuleType, *, errors: NvmlErrorCounts | None = None) -> None:
        self._nv = module
        self.errors = errors or NvmlErrorCounts()
        self._missing: set[str] = set()
        self._memory_v2: bool | None = None
        self._proc_version: dict[str, str] = {}
        # Last process-utilisation sample timestamp per device (µs, NVML's clock), so each
        # poll asks only for samples newer than the previous one.
        self._util_ts: dict[int, int] = {}
        # Per device: what the previous read found, kept by a re-read that comes before
        # the driver's next sample is due (see _read_process_sm).
        self._util_last: dict[int, dict[int, float]] = {}
        self._handles: dict[int, Any] = {}
        # MIG GPUs whose aggregate process lists and memory NVML refuses (NO_PERMISSION:
        # they need privileges this process lacks); read from their instances instead.
        self._per_instance: set[int] = set()
        self._health = HealthState()
        self._gpm = GpmState()
        self.driver_version: str | None = None
        self.nvml_version: str | None = None
        self.cuda_driver_version: str | None = None

    # -- lifecycle ---------------------------------------------------------------------

    @classmethod
    def open(cls, *, errors: NvmlErrorCounts | None = None) -> NvmlSession:
        """Initialise NVML. Raises :class:`NvmlUnavailable` with what to check."""
        try:
            import pynvml
        except ImportError as err:  # pragma: no cover - a hard dependency
            raise NvmlUnavailable("the nvidia-ml-py package is not installed") from err
        session = cls(pynvml, errors=errors)
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as err:
            raise NvmlUnavailable(_fatal_message(err.value)) from err
        session._read_versions()
        return session

    def close(self) -> None:
        self._close_health()
        self._close_gpm()
        try:
            self._nv.nvmlShutdown()
        except self._nv.NVMLError:
            log.debug("nvmlShutdown failed", exc_info=True)

    def __enter__(self) -> NvmlSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _read_versions(self) -> None:
        self.driver_version = self._optional("nvmlSystemGetDriverVersion", _to_str)
        self.nvml_version = self._optional("nvmlSystemGetNVMLVersion", _to_str)
        cuda = self._optional("nvmlSystemGetCudaDriverVersion_v2", int)
        if cuda is not None:
            self.cuda_driver_version = f"{cuda // 1000}.{cuda % 1000 // 10}"

    # -- the error boundary ------------------------------------------------------------

    def _call(self, function: str, *args: Any, symbol: str | None = None) -> Any:
        """Call ``pynvml.<function>``; per-field errors -> ``None``; lost -> :class:`GpuLost`.

        ``symbol`` names the C function when it differs from the Python one (pynvml's
        ``nvmlDeviceGetMemoryInfo(h, version)`` calls ``nvmlDeviceGetMemoryInfo_v2``), so
        a missing v2 symbol does not also disable the v1 call.
        """
        return self._attempt(function, *args, symbol=symbol)[0]

    def _attempt(
        self, function: str, *args: Any, symbol: str | None = None, quiet: tuple[int, ...] = ()
    ) -> tuple[Any, int]:
        """``(value, 0)``, or ``(None, code)`` for a per-field error, counted unless
        ``quiet`` lists its code (an answer, not a failure: TIMEOUT from an empty event
        set). GPU_IS_LOST raises :class:`GpuLost`."""
        symbol = symbol or function
        if symbol in self._missing:
            return None, NVML_ERROR_FUNCTION_NOT_FOUND
        try:
            return getattr(self._nv, function)(*args), 0
        except self._nv.NVMLError as err:
            code = err.value
            if code == NVML_ERROR_GPU_IS_LOST:
                raise GpuLost(symbol) from err
            if code == NVML_ERROR_FUNCTION_NOT_FOUND:
                self._missing.add(symbol)
                log.warning("NVML function %s is not in this driver; skipping it", symbol)
            if code not in quiet:
                self._count_error(symbol, code)
            return None, code

    def _count_error(self, symbol: str, code: int) -> None:
        self.errors.add(symbol, error_name(code))

    def _optional(self, function: str, convert: Callable[[Any], T], *args: Any) -> T | None:
        try:
            value = self._call(function, *args)
        except GpuLost:
            return None
        return None if value is None else convert(value)

    # -- devices -----------------------------------------------------------------------

    def device_count(self) -> int:
        try:
            return int(self._nv.nvmlDeviceGetCount())
        except self._nv.NVMLError as err:
            raise NvmlUnavailable(f"cannot count GPUs: {error_name(err.value)}") from err

    def _handle(self, index: int) -> tuple[Any, int]:
        """The device's handle and 0, or None and NVML's error code."""
        handle = self._handles.get(index)
        if handle is not None:
            return handle, 0
        handle, code = self._attempt("nvmlDeviceGetHandleByIndex", index)
        if handle is not None:
            self._handles[index] = handle
        return handle, code

    def read_device(self, index: int) -> DeviceReading:
        """Read everything gpuwatch needs from GPU ``index`` (``nvidia-smi -i INDEX -q``).

        Never raises for a device-level problem: a lost GPU comes back with
        ``lost=True``; an unreadable field is ``None``.
        """
        reading = DeviceReading(index=index, uuid=unknown_uuid(index))
        try:
            handle, code = self._handle(index)
            if handle is None:
                # NO_PERMISSION, UNKNOWN (a GPU gone since this process started: NVML
                # says GPU_IS_LOST only to a process that held its handle), IRQ_ISSUE,
                # INSUFFICIENT_POWER...: nothing of this GPU can be read, and an empty
                # list here would read as every process on it having ended.
                reading.read_error = f"no handle: {error_name(code)}"
                reading.processes_unlisted = True
                return reading
            uuid = self._call("nvmlDeviceGetUUID", handle)
            if uuid is not None:
                reading.uuid = _to_str(uuid)
            self._read_identity(handle, reading)
            mode = self._call("nvmlDeviceGetAddressingMode", handle)
            if mode is not None:
                reading.coherent_memory = mode == self._nv.NVML_DEVICE_ADDRESSING_MODE_ATS
            per_instance = index in self._per_instance
            refused = not per_instance and self._read_aggregate(handle, reading)
            mig_mode = self._mig_mode(index, handle)
            self._read_activity(handle, reading, mig_mode=mig_mode)
            self._read_health(index, handle, reading)
            reading.process_sm = self._read_process_sm(index, handle, mig_mode=mig_mode)
            instances = self._read_mig(handle) if mig_mode else []
            reading.mig = [mig for mig, _ in instances]
            if instances and (per_instance or refused):
                self._per_instance.add(index)
                self._read_from_instances(reading, instances)
            elif per_instance:
                # Out of MIG mode now (or its instances unreadable): the GPU's own
                # figures are what there is.
                self._per_instance.discard(index)
                self._read_aggregate(handle, reading)
            self._read_gpm(index, handle, reading)
        except GpuLost:
            # Keep what identifies the GPU; everything else is unknowable now.
            self._handles.pop(index, None)
            self._per_instance.discard(index)
            self._forget_gpm(index)
            self._util_last.pop(index, None)
            return DeviceReading(index=index, uuid=reading.uuid, name=reading.name, lost=True)
        return reading

    def _read_identity(self, handle: Any, reading: DeviceReading) -> None:
        name = self._call("nvmlDeviceGetName", handle)
        reading.name = None if name is None else _to_str(name)
        pci = self._call("nvmlDeviceGetPciInfo", handle)
        if pci is not None:
            reading.pci_bus_id = _to_str(pci.busId)

    def _read_aggregate(self, handle: Any, reading: DeviceReading) -> bool:
        """The GPU's memory and process lists through its own handle; True when NVML
        refused any of them for want of privileges (a MIG GPU, read unprivileged)."""
        # Processes, memory, processes again, back to back: see processes_before_memory.
        reading.processes_before_memory, _ = self._list_processes(handle)
        memory_code = self._read_memory(handle, reading)
        reading.processes, failed = self._list_processes(handle)
        reading.processes_unlisted = bool(failed)
        return NVML_ERROR_NO_PERMISSION in {*failed, memory_code}

    def _read_from_instances(
        self, reading: DeviceReading, instances: list[tuple[MigReading, Any]]
    ) -> None:
        """A MIG GPU's processes and memory as the sums of its instances'.

        NVML gives a MIG GPU's aggregate process lists and memory only to a privileged
        caller (root, or the MIG monitor capability); the agent runs unprivileged. Each
        instance's handle still answers, and together the instances hold every
        process. Memory is then what the instances hold and can hold: total is the
        instances' sum (less than the board's), and no reserved figure is known.
        """
        reading.processes, reading.processes_unlisted = [], False
        reading.processes_before_memory = None
        for mig, mig_handle in instances:
            listed, failed = self._list_processes(mig_handle)
            reading.processes_unlisted |= bool(failed)
            reading.processes += [
                p
                if p.gpu_instance_id is not None
                else replace(p, gpu_instance_id=mig.gpu_instance_id)
                for p in listed
            ]
        used = total = 0
        for mig, _ in instances:
            if mig.memory_used_bytes is None or mig.memory_total_bytes is None:
                reading.memory_used_bytes = reading.memory_total_bytes = None
                reading.memory_free_bytes = reading.memory_reserved_bytes = None
                return
            used += mig.memory_used_bytes
            total += mig.memory_total_bytes
        reading.memory_used_bytes, reading.memory_total_bytes = used, total
        reading.memory_free_bytes, reading.memory_reserved_bytes = total - used, None

    def _read_memory(self, handle: Any, reading: DeviceReading) -> int:
        """The memory figures into ``reading``; 0, or the code of the read that failed."""
        # v2 reports the driver's reserved memory separately from "used"; v1 folds it in.
        if self._memory_v2 is not False:
            try:
                mem, code = self._attempt(
                    "nvmlDeviceGetMemoryInfo",
                    handle,
                    self._nv.nvmlMemory_v2,
                    symbol="nvmlDeviceGetMemoryInfo_v2",
                )
            except TypeError:
                # Another library in this process replaced pynvml's wrapper with a
                # one-argument version (gpustat does, on import); use it as v1 below.
                mem, code = None, NVML_ERROR_FUNCTION_NOT_FOUND
                self._memory_v2 = False
            if mem is not None:
                self._memory_v2 = True
                reading.memory_total_bytes = int(mem.total)
                reading.memory_used_bytes = int(mem.used)
                reading.memory_free_bytes = int(mem.free)
                reading.memory_reserved_bytes = int(mem.reserved)
                return 0
            if code not in _MEMORY_V2_ABSENT:
                # This read failed (UNKNOWN, TIMEOUT...), not the v2 call: the fields are
                # unknown this time. Falling back would serve v1's "used", which counts
                # the reserved memory too, and on a first read would switch every GPU
                # to v1 for good.
                return code
            if self._memory_v2 is None:
                log.info("memory info v2 unavailable; using v1 (no separate reserved figure)")
                self._memory_v2 = False
        # v1's "used" includes the reserved memory: see memory_used_includes_reserved.
        mem, code = self._attempt("nvmlDeviceGetMemoryInfo", handle)
        if mem is not None:
            reading.memory_total_bytes = int(mem.total)
            reading.memory_used_bytes = int(mem.used)
            reading.memory_free_bytes = int(mem.free)
            reserved = getattr(mem, "reserved", None)  # present when a v2 struct came back
            reading.memory_reserved_bytes = None if reserved is None else int(reserved)
            reading.memory_used_includes_reserved = reserved is None
        return code

    def _read_activity(self, handle: Any, reading: DeviceReading, *, mig_mode: bool) -> None:
        # In MIG mode NVML has no GPU-wide utilization: NOT_SUPPORTED is its answer there,
        # not a failure (gpuwatch_nvml_errors_total counts failures). Still asked, in case
        # a driver adds it.
        util, _ = self._attempt(
            "nvmlDeviceGetUtilizationRates", handle, quiet=_MIG_UNSUPPORTED if mig_mode else ()
        )
        if util is not None:
            reading.utilization_ratio = min(int(util.gpu), 100) / 100.0
            reading.memory_busy_ratio = min(int(util.memory), 100) / 100.0
        temp = self._call("nvmlDeviceGetTemperature", handle, 0)  # NVML_TEMPERATURE_GPU
        reading.temperature_celsius = None if temp is None else float(temp)
        power = self._call("nvmlDeviceGetPowerUsage", handle)  # milliwatts
        reading.power_watts = None if power is None else power / 1000.0
        limit = self._call("nvmlDeviceGetEnforcedPowerLimit", handle)
        reading.power_limit_watts = None if limit is None else limit / 1000.0

    def _list_processes(self, handle: Any) -> tuple[list[ProcessUsage], set[int]]:
        """Compute, graphics and MPS contexts on the GPU, and the codes of the lists that
        failed (one the GPU or driver does not have is no failure)."""
        failed: set[int] = set()
        rows: dict[tuple[int, str], ProcessUsage] = {}
        kinds: tuple[tuple[Literal["compute", "graphics", "mps"], str], ...] = (
            ("compute", "nvmlDeviceGetComputeRunningProcesses"),
            ("graphics", "nvmlDeviceGetGraphicsRunningProcesses"),
            ("mps", "nvmlDeviceGetMPSComputeRunningProcesses"),
        )
        for kind, base in kinds:
            listed, code = self._process_list(base, handle)
            if code not in _NO_SUCH_LIST:
                failed.add(code)
            for proc in listed or ():
                used = proc.usedGpuMemory  # pynvml maps NVML_VALUE_NOT_AVAILABLE to None
                instance = getattr(proc, "gpuInstanceId", None)  # v2 and later
                rows[(int(proc.pid), kind)] = ProcessUsage(
                    pid=int(proc.pid),
                    kind=kind,
                    used_bytes=None if used is None else int(used),
                    gpu_instance_id=None
                    if instance is None or instance == _NO_INSTANCE
                    else int(instance),
                )
        return list(rows.values()), failed

    def _process_list(self, base: str, handle: Any) -> tuple[list[Any] | None, int]:
        """The list and NVML's return code (0, or the error: see :data:`_NO_SUCH_LIST`)."""
        # Probe v3 once, then v2; remember which one this driver has.
        known = self._proc_version.get(base)
        for suffix in [known] if known else ["_v3", "_v2"]:
            name = base + suffix
            if name in self._missing:
                continue
            result, code = self._attempt(name, handle)
            if name not in self._missing:
                self._proc_version[base] = suffix
                return result, code
        return None, NVML_ERROR_FUNCTION_NOT_FOUND

    def _read_process_sm(
        self, index: int, handle: Any, *, mig_mode: bool = False
    ) -> dict[int, float] | None:
        """Busy ratio per PID over the samples newer than the previous poll.

        A process's activity is its **busiest engine**: the highest of a sample's
        ``smUtil``, ``encUtil`` and ``decUtil``, so a process working only on the video
        encoder or decoder is not idle. A sample with all three at 0 is idle (0.0), the
        same as no sample. NVML keeps samples only for processes that used an engine, so
        a listed process with no sample was idle over the interval (0.0), and NOT_FOUND
        means "no samples at all since then". Other failures mean unknown (None).

        "No sample" is evidence of idleness only once the driver's next sample is due
        (:data:`PROCESS_SAMPLE_PERIOD_SECONDS` after the newest one seen; NVML stamps
        samples with this host's wall clock in µs). A re-read before that (``gpuwatch
        reap`` confirming right before a signal, milliseconds after its first poll)
        keeps what the previous read found, raised by any new sample: reading that
        silence as idle once let a busy process be killed. A newest sample stamped in
        the future (a clock step) is no reason to keep anything.
        """
        since = self._util_ts.get(index, 0)
        age = time.time() - since / 1_000_000
        if age < -CLOCK_STEP_SECONDS:
            # The wall clock stepped back past the newest sample seen (NTP, a VM
            # restore): the driver stamps new samples with the new time, so asking for
            # those after the old stamp would find none for as long as the step, and
            # every process would read idle. Ask for everything the driver still holds
            # instead (older activity may count once: busy, never falsely idle).
            since = 0
        quick = since > 0 and 0 <= age < PROCESS_SAMPLE_PERIOD_SECONDS
        busy: dict[int, float] = dict(self._util_last.get(index, {})) if quick else {}
        try:
            samples = self._nv.nvmlDeviceGetProcessUtilization(handle, since)
        except self._nv.NVMLError as err:
            if err.value == NVML_ERROR_GPU_IS_LOST:
                raise GpuLost("nvmlDeviceGetProcessUtilization") from err
            if err.value != NVML_ERROR_NOT_FOUND:
                # In MIG mode NOT_SUPPORTED is the answer (no per-process utilization).
                if not (mig_mode and err.value in _MIG_UNSUPPORTED):
                    self.errors.add("nvmlDeviceGetProcessUtilization", error_name(err.value))
                return None
            samples = []
        newest = since
        for sample in samples:
            newest = max(newest, int(sample.timeStamp))
            engine = max(int(sample.smUtil), int(sample.encUtil), int(sample.decUtil))
            ratio = min(engine, 100) / 100.0
            busy[int(sample.pid)] = max(busy.get(int(sample.pid), 0.0), ratio)
        self._util_ts[index] = newest
        self._util_last[index] = busy
        return dict(busy)

    def _mig_mode(self, index: int, handle: Any) -> bool:
        """Whether the GPU is in MIG mode now (its current mode, not the pending one)."""
        # A board without MIG answers NOT_SUPPORTED: asked once (see HealthReads._board).
        mode, _ = self._board(index, "nvmlDeviceGetMigMode", handle)
        return bool(mode and mode[0])

    def _read_mig(self, handle: Any) -> list[tuple[MigReading, Any]]:
        """Each MIG instance of a GPU in MIG mode, with its handle."""
        count = self._call("nvmlDeviceGetMaxMigDeviceCount", handle) or 0
        instances: list[tuple[MigReading, Any]] = []
        for i in range(int(count)):
            # Slots are probed up to the board's maximum; NOT_FOUND is an empty slot, an
            # answer every poll gives on a partly partitioned GPU, not a failure.
            mig, _ = self._attempt(
                "nvmlDeviceGetMigDeviceHandleByIndex", handle, i, quiet=(NVML_ERROR_NOT_FOUND,)
            )
            if mig is None:
                continue
            uuid = self._call("nvmlDeviceGetUUID", mig)
            name = None if (raw := self._call("nvmlDeviceGetName", mig)) is None else _to_str(raw)
            mem = self._call("nvmlDeviceGetMemoryInfo", mig)
            instance_id = self._call("nvmlDeviceGetGpuInstanceId", mig)
            instances.append(
                (
                    MigReading(
                        index=i,
                        uuid=_to_str(uuid) if uuid is not None else f"MIG-unknown-{i}",
                        name=name,
                        memory_total_bytes=None if mem is None else int(mem.total),
                        memory_used_bytes=None if mem is None else int(mem.used),
                        gpu_instance_id=None if instance_id is None else int(instance_id),
                        # "NVIDIA A100-SXM4-80GB MIG 3g.40gb" -> "3g.40gb", nvidia-smi's profile.
                        profile=name.rpartition(" MIG ")[2] if name and " MIG " in name else None,
                    ),
                    mig,
                )
            )
        return instances
