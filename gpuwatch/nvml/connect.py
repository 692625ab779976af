"""Open an NVML session on the real driver, or on simulated GPUs from a scenario."""

from __future__ import annotations

from gpuwatch.nvml.library import NvmlErrorCounts, NvmlSession


def connect(fake_gpus: str | None = None, *, errors: NvmlErrorCounts | None = None) -> NvmlSession:
    """Initialise NVML. With ``fake_gpus`` (a scenario path or bundled name), the fake
    library is installed beneath pynvml first, so the same code path runs either way.

    Raises :class:`~gpuwatch.errors.NvmlUnavailable` when there is no driver, and
    :class:`~gpuwatch.errors.ScenarioError` for a bad scenario.
    """
    if fake_gpus is not None:
        from gpuwatch.nvml import fake

        fake.install(fake_gpus)
    return NvmlSession.open(errors=errors)
