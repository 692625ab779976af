"""How a fake C symbol is declared: ``@nvml_symbol("nvmlDeviceGetName", mig=True)``.

The call groups (``calls_*.py``) are mixins of :class:`~gpuwatch.nvml.fake.library.
FakeNvmlLibrary`; each marked method implements one or more C symbols. The library's
dispatcher does what every NVML entry point does first (initialised? valid handle? GPU
lost? injected fault?) and then calls the method with the resolved device and the
scenario time ``t`` of this call, so one call sees one consistent moment.

Method signatures, by ``scope``:

* ``"system"``: ``method(self, t, *c_args)``
* ``"index"``:  ``method(self, gpu, t, *c_args_after_index)`` (handle lookups by index)
* ``"device"``: ``method(self, device, t, *c_args_after_handle)``
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from gpuwatch.nvml.fake.host import FakeHost
from gpuwatch.nvml.fake.scenario import GpuSpec, MigSpec

Scope = Literal["system", "index", "device"]
F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class SymbolInfo:
    names: tuple[str, ...]
    scope: Scope
    mig: bool  # accepts MIG device handles (others answer NOT_SUPPORTED for them)
    before_init: bool  # callable before nvmlInit (init itself, nvmlErrorString)


def nvml_symbol(
    *names: str, scope: Scope = "device", mig: bool = False, before_init: bool = False
) -> Callable[[F], F]:
    """Mark a method as the implementation of the C symbols ``names``."""

    def mark(method: F) -> F:
        method._nvml_symbol = SymbolInfo(names, scope, mig, before_init)  # type: ignore[attr-defined]
        return method

    return mark


@dataclass(frozen=True)
class DeviceRef:
    """A resolved device handle: a GPU, or one of its MIG instances."""

    gpu: GpuSpec
    mig: MigSpec | None

    @property
    def index(self) -> int:
        return self.gpu.index

    @property
    def mig_index(self) -> int | None:
        return None if self.mig is None else self.mig.index


class CallsBase:
    """What every call group may use: the host being simulated."""

    host: FakeHost
