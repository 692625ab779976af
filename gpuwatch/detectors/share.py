"""Runaway share: one process holding most of a GPU that others need too."""

from __future__ import annotations

from gpuwatch.detectors._format import format_bytes
from gpuwatch.detectors.types import Finding
from gpuwatch.snapshot import Gpu, GpuProcess


def detect_share(process: GpuProcess, gpu: Gpu, *, share_ratio: float) -> Finding | None:
    """Return a ``runaway``/``share`` finding if ``process`` holds more than ``share_ratio``
    (0..1) of ``gpu.memory_total_bytes`` on a shared GPU.

    Shared means at least two processes on the GPU (which is also the case whenever
    two distinct users are on it). A process alone on its GPU is using what it was
    given, so it is never runaway by share. MIG parents are skipped: each process is
    confined to its instance, so a share of the whole board means nothing.

    Evidence: ``share_ratio`` (held / total), ``threshold_ratio``, ``gpu_total_bytes``,
    ``processes`` on the GPU and ``users`` (sorted names of the known users).
    """
    used, total = process.used_bytes, gpu.memory_total_bytes
    if used is None or not total or gpu.mig_instances:
        return None
    share = used / total
    # Before the sharing test: this runs for every process of every snapshot, and
    # nearly all of them hold less than the threshold.
    if share <= share_ratio:
        return None
    pids = {p.pid for p in gpu.processes} | {process.pid}
    if len(pids) < 2:
        return None
    users = sorted({p.owner.user for p in (*gpu.processes, process) if p.owner.user is not None})
    return Finding(
        kind="runaway",
        reason="share",
        summary=(
            f"holds {share:.0%} ({format_bytes(used)} of {format_bytes(total)}) "
            f"of GPU {gpu.index}, shared by {len(pids)} processes"
        ),
        held_bytes=used,
        evidence={
            "share_ratio": share,
            "threshold_ratio": share_ratio,
            "gpu_total_bytes": total,
            "processes": len(pids),
            "users": users,
        },
    )
