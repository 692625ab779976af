"""Fake GPUs beneath pynvml: for ``gpuwatch demo``, CI, and anyone without a GPU.

A scenario file (``docs/scenarios.md``) describes GPUs, the processes holding them
and the faults to inject. :func:`install` puts a :class:`FakeNvmlLibrary` where pynvml
expects ``libnvidia-ml.so.1``, so the real pynvml code runs unchanged on top of it, and
boots the scenario's stand-in processes once per host, so every process (the agent,
``gpuwatch status``, unmodified gpustat or nvitop under ``gpuwatch fake-nvml exec``)
sees the same GPUs and PIDs::

    from gpuwatch.nvml import fake
    host = fake.install("workstation")      # or a path to a .toml file
    ...                                     # pynvml now reads the fake GPUs
    fake.uninstall(); host.stop()

Modules, in the order data flows:

``scenario_file`` -> ``scenario`` (+ ``timeline``, ``quantities``)   what the file says
``lifecycle``, ``supervisor``, ``standin``, ``runtime_state``, ``procfs``   real stand-in processes
``host``                                       the GPUs and processes at a moment
``library`` (+ ``calls_*``, ``symbols``, ``cargs``)   the C symbols pynvml calls (``calls_gpm``: GPM)
``installation``                               install / uninstall beneath pynvml
``inject/sitecustomize.py``                    the same, inside any Python program
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gpuwatch.nvml.fake.host import FakeHost
from gpuwatch.nvml.fake.installation import install, installed_host, stop, uninstall
from gpuwatch.nvml.fake.scenario import Scenario
from gpuwatch.nvml.fake.scenario_file import bundled_scenario_names, load_scenario

if TYPE_CHECKING:
    from gpuwatch.nvml.fake.library import FakeNvmlLibrary

__all__ = [
    "FakeHost",
    "FakeNvmlLibrary",
    "Scenario",
    "bundled_scenario_names",
    "install",
    "installed_host",
    "load_scenario",
    "stop",
    "uninstall",
]


def __getattr__(name: str) -> Any:
    # The library imports pynvml; the supervisor and stand-ins never need it.
    if name == "FakeNvmlLibrary":
        from gpuwatch.nvml.fake.library import FakeNvmlLibrary

        return FakeNvmlLibrary
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
