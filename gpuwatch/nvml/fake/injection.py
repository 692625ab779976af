"""The environment that makes any Python program run on a scenario's fake GPUs.

Used by ``gpuwatch fake-nvml exec``: the program gets ``inject/`` first on PYTHONPATH
(so its ``sitecustomize.py`` runs at start-up) and the scenario in
``GPUWATCH_FAKE_NVML_*`` variables, documented in ``inject/sitecustomize.py``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import gpuwatch

INJECT_DIR = Path(__file__).with_name("inject")


def injection_environment(
    base: Mapping[str, str], scenario_file: Path, runtime_dir: Path, *, at: str | None = None
) -> dict[str, str]:
    """``base`` (the caller's environment) plus what the fake needs in the child.

    The scenario is passed as a resolved file path, so the child reads exactly the file
    that was booted, whatever its working directory.
    """
    env = dict(base)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(INJECT_DIR), base.get("PYTHONPATH")) if p)
    env["GPUWATCH_FAKE_NVML_SCENARIO"] = str(scenario_file.resolve())
    env["GPUWATCH_FAKE_NVML_RUNTIME_DIR"] = str(runtime_dir.resolve())
    env["GPUWATCH_FAKE_NVML_ROOT"] = str(Path(gpuwatch.__file__).resolve().parent.parent)
    if at is not None:
        env["GPUWATCH_FAKE_NVML_AT"] = at
    else:
        env.pop("GPUWATCH_FAKE_NVML_AT", None)
    return env
