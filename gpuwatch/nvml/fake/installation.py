"""Put the fake library beneath pynvml (``pynvml.nvmlLib``), and take it away again.

pynvml loads ``libnvidia-ml.so.1`` only while its module global ``nvmlLib`` is None,
and caches every symbol it looks up; so installing means setting ``nvmlLib`` and
clearing that cache, under pynvml's own lock. Install before the program's first
``nvmlInit``: handles obtained from a real driver mean nothing to the fake.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from gpuwatch.nvml.fake import lifecycle
from gpuwatch.nvml.fake.host import Clock, FakeHost
from gpuwatch.nvml.fake.runtime_state import prepare_runtime_dir
from gpuwatch.nvml.fake.scenario import Scenario


@dataclass
class _Installed:
    host: FakeHost
    previous_library: Any


# Set by install(), under pynvml's own lock (pynvml.libLoadLock).
_installed: _Installed | None = None


def install(
    scenario: str | os.PathLike[str] | Scenario,
    *,
    clock: Clock | None = None,
    runtime_dir: str | os.PathLike[str] | None = None,
    at: float | None = None,
) -> FakeHost:
    """Simulate ``scenario`` (a path, a bundled name such as ``"workstation"``, or a
    loaded :class:`Scenario`) beneath pynvml in this process, booting its stand-in
    processes on the host if no other process has.

    ``clock`` returns Unix seconds (default ``time.time``); ``at`` freezes the scenario
    at that many scenario seconds; ``runtime_dir`` holds the shared state (default
    ``$XDG_RUNTIME_DIR/gpuwatch-fake``). Installing again replaces the previous fake.

    Raises ScenarioError for a bad scenario, ConfigError for an unusable runtime dir,
    GpuwatchError when the stand-ins cannot be started.
    """
    global _installed
    import pynvml

    from gpuwatch.nvml.fake.library import FakeNvmlLibrary, is_implemented
    from gpuwatch.nvml.fake.scenario_file import load_scenario

    spec = (
        scenario
        if isinstance(scenario, Scenario)
        else load_scenario(scenario, known_symbols=is_implemented)
    )
    directory = prepare_runtime_dir(runtime_dir)
    host = FakeHost(
        spec, lifecycle.ensure_running(spec, directory), runtime_dir=directory, clock=clock, at=at
    )
    with pynvml.libLoadLock:
        previous = _installed.previous_library if _installed is not None else pynvml.nvmlLib
        pynvml.nvmlLib = FakeNvmlLibrary(host)
        pynvml._nvmlGetFunctionPointer_cache.clear()
        _installed = _Installed(host, previous)
    return host


def uninstall() -> None:
    """Restore whatever ``pynvml.nvmlLib`` was before :func:`install` (usually None, so
    the next ``nvmlInit`` loads the real driver). Stand-ins keep running for the other
    processes; stop them with :func:`gpuwatch.nvml.fake.stop` or ``FakeHost.stop()``.
    """
    global _installed
    import pynvml

    with pynvml.libLoadLock:
        if _installed is None:
            return
        pynvml.nvmlLib = _installed.previous_library
        pynvml._nvmlGetFunctionPointer_cache.clear()
        _installed = None


def installed_host() -> FakeHost | None:
    """The host currently installed in this process, if any."""
    return None if _installed is None else _installed.host


def stop(
    scenario: str | os.PathLike[str] | Scenario,
    *,
    runtime_dir: str | os.PathLike[str] | None = None,
) -> list[int]:
    """Kill ``scenario``'s stand-ins (for every process on the host) and remove its state.

    Returns the PIDs signalled; attached and ghost PIDs are never signalled. Raises
    ScenarioError for a bad scenario, ConfigError for an unusable runtime dir.
    """
    from gpuwatch.nvml.fake.scenario_file import load_scenario

    spec = scenario if isinstance(scenario, Scenario) else load_scenario(scenario)
    return lifecycle.stop(spec, prepare_runtime_dir(runtime_dir))
