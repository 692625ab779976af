"""Fake GPUs beneath pynvml in any Python program (``gpuwatch fake-nvml exec``).

``gpuwatch fake-nvml exec SCENARIO -- CMD`` puts this directory first on PYTHONPATH,
so Python's ``site`` module imports this file at start-up, and passes the scenario in
the environment. This is the one place that reads those variables, because it runs
inside programs that know nothing of gpuwatch's settings:

``GPUWATCH_FAKE_NVML_SCENARIO``     scenario file (required; absent: do nothing)
``GPUWATCH_FAKE_NVML_RUNTIME_DIR``  shared runtime dir (default: as ``install()``)
``GPUWATCH_FAKE_NVML_AT``           freeze scenario time here, e.g. ``"1h"``
``GPUWATCH_FAKE_NVML_ROOT``         the directory holding the ``gpuwatch`` package, used
                                    only if this interpreter cannot import it otherwise

It costs almost nothing: until the program imports ``pynvml``, all it does is sit on
``sys.meta_path`` and decline every other name. When ``pynvml`` has been imported, the
fake is installed beneath it, before the program can call ``nvmlInit``. A
``sitecustomize`` that this one shadows (later on ``sys.path``) still runs, first.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types
from typing import Any

_SCENARIO = "GPUWATCH_FAKE_NVML_SCENARIO"
_RUNTIME_DIR = "GPUWATCH_FAKE_NVML_RUNTIME_DIR"
_AT = "GPUWATCH_FAKE_NVML_AT"
_ROOT = "GPUWATCH_FAKE_NVML_ROOT"


def _install_fake() -> None:
    """Install the scenario beneath the just-imported pynvml; ImportError if impossible."""
    try:
        from gpuwatch.nvml import fake
    except ImportError:
        root = os.environ.get(_ROOT)
        if not root:
            raise
        sys.path.append(root)  # last: the program's own packages keep precedence
        from gpuwatch.nvml import fake
    from gpuwatch.errors import GpuwatchError
    from gpuwatch.quantities import parse_seconds

    try:
        at_text = os.environ.get(_AT)
        fake.install(
            os.environ[_SCENARIO],
            runtime_dir=os.environ.get(_RUNTIME_DIR) or None,
            at=parse_seconds(at_text) if at_text else None,
        )
    except (GpuwatchError, ValueError) as err:
        raise ImportError(f"pynvml: gpuwatch fake GPUs could not be installed: {err}") from err


class _InstallAfterExec(importlib.abc.Loader):
    """Runs pynvml's own loader, then installs the fake beneath the fresh module."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self._loader.create_module(spec)  # type: ignore[no-any-return]

    def exec_module(self, module: types.ModuleType) -> None:
        self._loader.exec_module(module)
        _install_fake()


class _PynvmlWatcher(importlib.abc.MetaPathFinder):
    """Declines every import except the first ``pynvml``, whose loader it wraps."""

    def find_spec(
        self, name: str, path: Any = None, target: Any = None
    ) -> importlib.machinery.ModuleSpec | None:
        if name != "pynvml":
            return None
        sys.meta_path.remove(self)  # once: the normal finders locate the real module
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None:
            spec.loader = _InstallAfterExec(spec.loader)
        return spec


def _run_shadowed_sitecustomize() -> None:
    """Import the next ``sitecustomize`` on sys.path, which this file hides."""
    here = os.path.dirname(os.path.abspath(__file__))
    ours = sys.modules.pop("sitecustomize", None)
    saved = sys.path[:]
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    try:
        import sitecustomize  # noqa: F401
    except ImportError as err:
        if err.name != "sitecustomize":
            raise
    finally:
        sys.path[:] = saved
        if ours is not None:
            sys.modules["sitecustomize"] = ours


_run_shadowed_sitecustomize()
if os.environ.get(_SCENARIO) and "pynvml" not in sys.modules:
    sys.meta_path.insert(0, _PynvmlWatcher())
