"""``FakeNvmlLibrary``: an object that stands in for ``libnvidia-ml.so.1`` beneath pynvml.

pynvml looks C symbols up with ``getattr(pynvml.nvmlLib, name)`` and calls them with
ctypes arguments; an AttributeError becomes NVML_ERROR_FUNCTION_NOT_FOUND. With this
object as ``nvmlLib``, the real pynvml code runs unchanged and gets NVML's own return
codes. Each symbol is a :class:`FakeFunction`, which, like a ctypes function pointer,
accepts ``restype``/``argtypes`` assignment (pynvml sets ``restype`` on some).

Every call first does what NVML does: NVML_ERROR_UNINITIALIZED before ``nvmlInit``,
NVML_ERROR_INVALID_ARGUMENT for a handle the library did not issue, then the
scenario's faults: NVML_ERROR_GPU_IS_LOST for every call on a lost GPU, the
kind's error code for the other kinds (``no_permission``, ``unknown``, ...; from
nvmlInit for ``driver_not_loaded`` and ``lib_rm_version_mismatch``), a real
(bounded) sleep for ``hang``. Symbols a program asks for but the fake lacks are logged once at DEBUG and
collected in :attr:`FakeNvmlLibrary.missing`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import pynvml as nv

from gpuwatch.nvml.fake import cargs
from gpuwatch.nvml.fake.calls_device import DeviceCalls
from gpuwatch.nvml.fake.calls_events import EventCalls, EventSets
from gpuwatch.nvml.fake.calls_gpm import GpmCalls, GpmSamples
from gpuwatch.nvml.fake.calls_health import HealthCalls
from gpuwatch.nvml.fake.calls_mig import MigCalls
from gpuwatch.nvml.fake.calls_processes import ProcessCalls
from gpuwatch.nvml.fake.calls_system import SystemCalls
from gpuwatch.nvml.fake.host import FakeHost
from gpuwatch.nvml.fake.scenario import symbol_family
from gpuwatch.nvml.fake.symbols import DeviceRef, SymbolInfo, nvml_symbol

log = logging.getLogger(__name__)

_FAULT_CODES = {
    "unsupported": nv.NVML_ERROR_NOT_SUPPORTED,
    "no_permission": nv.NVML_ERROR_NO_PERMISSION,
    "unknown": nv.NVML_ERROR_UNKNOWN,
    "timeout": nv.NVML_ERROR_TIMEOUT,
    "function_not_found": nv.NVML_ERROR_FUNCTION_NOT_FOUND,
    "insufficient_power": nv.NVML_ERROR_INSUFFICIENT_POWER,
    "irq_issue": nv.NVML_ERROR_IRQ_ISSUE,
    "reset_required": nv.NVML_ERROR_RESET_REQUIRED,
    "driver_not_loaded": nv.NVML_ERROR_DRIVER_NOT_LOADED,
    "lib_rm_version_mismatch": nv.NVML_ERROR_LIB_RM_VERSION_MISMATCH,
}


class FakeFunction:
    """One C symbol: called like a ctypes function pointer, returns an NVML code."""

    def __init__(self, name: str, call: Callable[..., Any]) -> None:
        self.__name__ = name
        self._call = call
        # Attributes pynvml (or a caller) may set on a ctypes function pointer; unused.
        self.restype: Any = None
        self.argtypes: Any = None
        self.errcheck: Any = None

    def __call__(self, *args: Any) -> Any:
        return self._call(*args)

    def __repr__(self) -> str:
        return f"<fake NVML function {self.__name__}>"


def implemented_symbols() -> dict[str, tuple[str, SymbolInfo]]:
    """C symbol -> (method name, declaration), for every symbol the fake implements."""
    table: dict[str, tuple[str, SymbolInfo]] = {}
    for attribute in dir(FakeNvmlLibrary):
        info = getattr(getattr(FakeNvmlLibrary, attribute), "_nvml_symbol", None)
        if isinstance(info, SymbolInfo):
            for name in info.names:
                table[name] = (attribute, info)
    return table


def is_implemented(symbol: str) -> bool:
    """True for a symbol (or a versionless family such as ``nvmlDeviceGetMemoryInfo``)."""
    return any(name == symbol or symbol_family(name) == symbol for name in implemented_symbols())


class FakeNvmlLibrary(
    SystemCalls, DeviceCalls, HealthCalls, EventCalls, ProcessCalls, MigCalls, GpmCalls
):
    """The fake C library for one :class:`FakeHost`. Thread-safe, like NVML."""

    def __init__(self, host: FakeHost) -> None:
        self.host = host
        self.event_sets = EventSets()
        self.gpm_samples = GpmSamples()
        self.missing: set[str] = set()
        self._init_count = 0
        self._lock = threading.Lock()
        self._functions = {
            name: FakeFunction(name, self._dispatcher(name, getattr(self, attribute), info))
            for name, (attribute, info) in implemented_symbols().items()
        }

    def __getattr__(self, name: str) -> FakeFunction:
        # Only reached for names that are not normal attributes: the C symbols.
        functions = self.__dict__.get("_functions", {})
        if name in functions:
            return functions[name]
        missing = self.__dict__.get("missing")
        if missing is not None and name.startswith("nvml") and name not in missing:
            missing.add(name)
            log.debug("fake NVML has no %s; pynvml reports FUNCTION_NOT_FOUND", name)
        raise AttributeError(name)

    # -- the checks every entry point makes --------------------------------------------

    def _dispatcher(
        self, symbol: str, method: Callable[..., int], info: SymbolInfo
    ) -> Callable[..., Any]:
        def call(*args: Any) -> Any:
            if not info.before_init and self._init_count == 0:
                return nv.NVML_ERROR_UNINITIALIZED
            t = self.host.scenario_time()
            if info.scope == "system":
                return self._guarded(symbol, None, t, lambda: method(t, *args))
            if not args:
                return nv.NVML_ERROR_INVALID_ARGUMENT
            if info.scope == "index":
                gpu = int(cargs.value(args[0]))
                if not 0 <= gpu < len(self.host.scenario.gpus):
                    return nv.NVML_ERROR_INVALID_ARGUMENT
                return self._guarded(symbol, gpu, t, lambda: method(gpu, t, *args[1:]))
            device = self._device(args[0])
            if device is None:
                return nv.NVML_ERROR_INVALID_ARGUMENT
            if device.mig is not None and not info.mig:
                return nv.NVML_ERROR_NOT_SUPPORTED
            return self._guarded(
                symbol, device.index, t, lambda: method(device, t, *args[1:]), device.mig_index
            )

        return call

    def _guarded(
        self,
        symbol: str,
        gpu: int | None,
        t: float,
        run: Callable[[], Any],
        mig: int | None = None,
    ) -> Any:
        if gpu is not None and self.host.lost(gpu, t):
            return nv.NVML_ERROR_GPU_IS_LOST
        fault = self.host.fault(symbol, gpu, t, mig)
        if fault is not None and fault.kind == "hang":
            log.debug("fake NVML: %s hangs for %.1f s (scenario fault)", symbol, fault.seconds)
            time.sleep(fault.seconds)
        elif fault is not None:
            return _FAULT_CODES[fault.kind]
        return run()

    def _device(self, handle: Any) -> DeviceRef | None:
        decoded = cargs.decode_handle(handle)
        if decoded is None:
            return None
        gpu, mig = decoded
        gpus = self.host.scenario.gpus
        if gpu >= len(gpus) or (mig is not None and mig >= len(gpus[gpu].mig)):
            return None
        return DeviceRef(gpus[gpu], None if mig is None else gpus[gpu].mig[mig])

    # -- initialisation and errors -----------------------------------------------------

    @nvml_symbol("nvmlInit", "nvmlInit_v2", scope="system", before_init=True)
    def init(self, t: float) -> int:
        with self._lock:
            self._init_count += 1
        return nv.NVML_SUCCESS

    @nvml_symbol("nvmlInitWithFlags", scope="system", before_init=True)
    def init_with_flags(self, t: float, flags: Any) -> int:
        return self.init(t)

    @nvml_symbol("nvmlShutdown", scope="system", before_init=True)
    def shutdown(self, t: float) -> int:
        """Each nvmlInit needs one nvmlShutdown; one too many is UNINITIALIZED."""
        with self._lock:
            if self._init_count == 0:
                return nv.NVML_ERROR_UNINITIALIZED
            self._init_count -= 1
        return nv.NVML_SUCCESS

    @nvml_symbol("nvmlErrorString", scope="system", before_init=True)
    def error_string(self, t: float, result: Any) -> bytes:
        """The C string NVML returns (bytes; pynvml sets ``restype = c_char_p``)."""
        code = int(cargs.value(result))
        return nv.NVMLError._errcode_to_string.get(code, "Unknown Error").encode()
