"""NVML misbehaving on one GPU, beneath pynvml, for faults the scenario format lacks.

Scenario ``[[fault]]`` entries cover ``gpu_lost``, ``unsupported``, ``no_permission``
and ``hang``. NVML can also answer ``NVML_ERROR_UNKNOWN`` (999) or
``NVML_ERROR_TIMEOUT`` (10), and a GPU can fall off the bus in the middle of a poll.
:class:`Misbehaving` sits where the fake installed itself (``pynvml.nvmlLib``) and
passes every call through to the fake library, except the ones a test aims at: those
answer a chosen return code, or run a hook first (to move the scenario clock, so a
``gpu_lost`` fault starts between two calls of one read). The real pynvml still turns
the codes into ``NVMLError``; gpuwatch sees exactly what a driver would give it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pynvml

from gpuwatch.nvml.fake import cargs
from gpuwatch.nvml.fake.library import FakeFunction
from gpuwatch.nvml.fake.scenario import symbol_family

NVML_ERROR_TIMEOUT = 10
NVML_ERROR_UNKNOWN = 999


@dataclass
class Rule:
    """Calls of ``family`` on GPU ``gpu`` (``None``: calls about no GPU, such as
    ``nvmlDeviceGetCount``): answer ``code``, or run ``before`` first."""

    family: str
    gpu: int | None
    code: int | None = None
    before: Callable[[], None] | None = None
    once: bool = False


class Misbehaving:
    """The fake C library with rules on top; install with :func:`misbehave`."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.rules: list[Rule] = []
        self.calls: list[tuple[str, int | None]] = []

    def __getattr__(self, name: str) -> Any:
        target = getattr(self._inner, name)  # AttributeError: FUNCTION_NOT_FOUND, as before
        if not name.startswith("nvml"):
            return target

        def call(*args: Any) -> Any:
            gpu = _gpu_of(name, args)
            for rule in list(self.rules):
                if gpu == rule.gpu and symbol_family(name) == rule.family:
                    if rule.once:
                        self.rules.remove(rule)
                    if rule.before is not None:
                        rule.before()
                    if rule.code is not None:
                        return rule.code
            return target(*args)

        return FakeFunction(name, call)


def _gpu_of(name: str, args: tuple[Any, ...]) -> int | None:
    if not args:
        return None
    if name.startswith("nvmlDeviceGetHandleByIndex"):
        return int(cargs.value(args[0]))
    decoded = cargs.decode_handle(args[0])
    return None if decoded is None else decoded[0]


def misbehave() -> Misbehaving:
    """Wrap the installed fake library (call after ``fake.install``); ``fake.uninstall``
    puts back what was there before the fake."""
    with pynvml.libLoadLock:
        wrapper = Misbehaving(pynvml.nvmlLib)
        pynvml.nvmlLib = wrapper
        pynvml._nvmlGetFunctionPointer_cache.clear()
    return wrapper
