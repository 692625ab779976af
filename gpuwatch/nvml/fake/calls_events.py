"""Event sets: the scenario's Xid errors, delivered as NVML delivers them.

A program creates a set (``nvmlEventSetCreate``), registers devices on it for
``nvmlEventTypeXidCriticalError`` (``nvmlDeviceRegisterEvents``) and waits
(``nvmlEventSetWait_v2``). As on a real driver, a set sees only the events that happen
after the device was registered, each once, in time order; a wait with nothing to
deliver answers NVML_ERROR_TIMEOUT once its timeout has passed (at once for 0 ms).
Only Xid events are simulated; the other event types register but never fire.
"""

from __future__ import annotations

import bisect
import ctypes
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import pynvml as nv

from gpuwatch.nvml.fake import cargs
from gpuwatch.nvml.fake.symbols import CallsBase, DeviceRef, nvml_symbol

_SET_BASE = 0x6771_0000
_SET_MASK = 0xFFFF_0000
_SUPPORTED_EVENTS = (
    nv.nvmlEventTypeXidCriticalError
    | nv.nvmlEventTypeSingleBitEccError
    | nv.nvmlEventTypeDoubleBitEccError
)
_WAIT_STEP_SECONDS = 0.05


@dataclass
class _EventSet:
    # GPU index -> position of the next undelivered event in that GPU's Xid list.
    cursors: dict[int, int] = field(default_factory=dict)


class EventSets:
    """The event sets one library has handed out, by handle address. Thread-safe."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._sets: dict[int, _EventSet] = {}
        self._issued = 0

    def create(self) -> int:
        with self.lock:
            self._issued += 1
            token = _SET_BASE | (self._issued & 0xFFFF)
            self._sets[token] = _EventSet()
            return token

    def free(self, token: int) -> None:
        with self.lock:
            self._sets.pop(token, None)

    def resolve(self, handle: Any) -> tuple[int, _EventSet] | None:
        try:
            address = ctypes.cast(handle, ctypes.c_void_p).value
        except (ctypes.ArgumentError, TypeError):
            return None
        if address is None or address & _SET_MASK != _SET_BASE:
            return None
        found = self._sets.get(address)
        return None if found is None else (address, found)


class EventCalls(CallsBase):
    event_sets: EventSets

    @nvml_symbol("nvmlEventSetCreate", scope="system")
    def event_set_create(self, t: float, handle: Any) -> int:
        if handle is None:
            return nv.NVML_ERROR_INVALID_ARGUMENT
        cargs.set_handle(handle, self.event_sets.create())
        return nv.NVML_SUCCESS

    @nvml_symbol("nvmlEventSetFree", scope="system")
    def event_set_free(self, t: float, handle: Any) -> int:
        found = self.event_sets.resolve(handle)
        if found is None:
            return nv.NVML_ERROR_INVALID_ARGUMENT
        self.event_sets.free(found[0])
        return nv.NVML_SUCCESS

    @nvml_symbol("nvmlDeviceGetSupportedEventTypes")
    def device_get_supported_event_types(self, device: DeviceRef, t: float, types: Any) -> int:
        if types is None:
            return nv.NVML_ERROR_INVALID_ARGUMENT
        cargs.store(types, _SUPPORTED_EVENTS)
        return nv.NVML_SUCCESS

    @nvml_symbol("nvmlDeviceRegisterEvents")
    def device_register_events(self, device: DeviceRef, t: float, types: Any, handle: Any) -> int:
        wanted = int(cargs.value(types))
        if wanted & ~_SUPPORTED_EVENTS:
            return nv.NVML_ERROR_NOT_SUPPORTED
        found = self.event_sets.resolve(handle)
        if found is None:
            return nv.NVML_ERROR_INVALID_ARGUMENT
        if wanted & nv.nvmlEventTypeXidCriticalError:
            times = [at for at, _ in device.gpu.health.xid]
            with self.event_sets.lock:
                found[1].cursors.setdefault(device.index, bisect.bisect_right(times, t))
        return nv.NVML_SUCCESS

    @nvml_symbol("nvmlEventSetWait", "nvmlEventSetWait_v2", scope="system")
    def event_set_wait(self, t: float, handle: Any, data: Any, timeout_ms: Any) -> int:
        found = self.event_sets.resolve(handle)
        if found is None or data is None:
            return nv.NVML_ERROR_INVALID_ARGUMENT
        event_set = found[1]
        deadline = time.monotonic() + int(cargs.value(timeout_ms)) / 1000
        while True:
            event = self._next_event(event_set, self.host.scenario_time())
            if event is not None:
                gpu, code = event
                struct = cargs.target(data)
                offset = type(struct).device.offset
                ctypes.c_void_p.from_buffer(struct, offset).value = cargs.handle_token(gpu, None)
                struct.eventType = nv.nvmlEventTypeXidCriticalError
                struct.eventData = code
                struct.gpuInstanceId = 0xFFFFFFFF
                struct.computeInstanceId = 0xFFFFFFFF
                return nv.NVML_SUCCESS
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return nv.NVML_ERROR_TIMEOUT
            time.sleep(min(_WAIT_STEP_SECONDS, remaining))

    def _next_event(self, event_set: _EventSet, now: float) -> tuple[int, int] | None:
        """The earliest due, undelivered Xid across the set's devices; marks it delivered."""
        gpus = self.host.scenario.gpus
        with self.event_sets.lock:
            due = [
                (gpus[gpu].health.xid[cursor][0], gpu)
                for gpu, cursor in event_set.cursors.items()
                if cursor < len(gpus[gpu].health.xid) and gpus[gpu].health.xid[cursor][0] <= now
            ]
            if not due:
                return None
            _, gpu = min(due)
            cursor = event_set.cursors[gpu]
            event_set.cursors[gpu] = cursor + 1
            return gpu, gpus[gpu].health.xid[cursor][1]
