"""Unattributed memory: used on a GPU but held by no process NVML lists."""

from __future__ import annotations

from gpuwatch.detectors._format import format_bytes
from gpuwatch.detectors.types import Finding
from gpuwatch.snapshot import Gpu


def detect_unattributed(gpu: Gpu, *, min_bytes: int) -> Finding | None:
    """Return an ``orphaned``/``unattributed`` finding if at least ``min_bytes`` of
    ``gpu.unattributed_bytes`` (used minus the sum of listed processes) is unowned.

    Masked, with no finding, where "used minus processes" is not a leak signal: the
    agent cannot see the processes (``processes_visible`` is False), the GPU's memory
    is coherent with the CPU (Grace Hopper: "used" includes system allocations), the
    GPU is split into MIG instances (processes are listed per instance), or the GPU
    could not be read this poll (``lost`` or ``read_error``).

    Evidence: ``unattributed_bytes``, ``gpu_used_bytes``, ``processes``.
    """
    unattributed = gpu.unattributed_bytes
    masked = (
        not gpu.processes_visible
        or gpu.coherent_memory
        or bool(gpu.mig_instances)
        or gpu.lost
        or gpu.read_error is not None
    )
    if masked or unattributed is None or unattributed < min_bytes:
        return None
    return Finding(
        kind="orphaned",
        reason="unattributed",
        summary=(
            f"{format_bytes(unattributed)} of GPU {gpu.index} is used by no listed process "
            "(a leaked context, or a process in another container)"
        ),
        held_bytes=unattributed,
        evidence={
            "unattributed_bytes": unattributed,
            "gpu_used_bytes": gpu.memory_used_bytes,
            "processes": len(gpu.processes),
        },
    )
