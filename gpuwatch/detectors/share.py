"""Runaway share: one process holding most of a GPU that others need too."""

from __future__ import annotations

from gpuwatch.detectors._format import format_bytes
from gpuwatch.detectors.types import Finding
from gpuwatch.snapshot import Gpu, GpuProcess

# Another holder counts as sharing the GPU from this share of its memory: a compute
# process that small (a monitoring probe, a CUDA context left idle) competes for little,
# and a graphics client (a display server, a compositor, a desktop app) below the larger
# share is the workstation's own desktop, not a second job.
OTHER_COMPUTE_RATIO = 0.01
OTHER_GRAPHICS_RATIO = 0.10


def _competes(other: GpuProcess, total: int) -> bool:
    """Whether ``other`` holds enough of the GPU to compete for it. Unknown memory (a
    process whose use NVML would not report) counts for a compute process only."""
    graphics = other.kind == "graphics"
    if other.used_bytes is None:
        return not graphics
    return other.used_bytes >= (OTHER_GRAPHICS_RATIO if graphics else OTHER_COMPUTE_RATIO) * total


def detect_share(process: GpuProcess, gpu: Gpu, *, share_ratio: float) -> Finding | None:
    """Return a ``runaway``/``share`` finding if ``process`` holds more than ``share_ratio``
    (0..1) of ``gpu.memory_total_bytes`` on a shared GPU.

    Shared means at least one other process on the GPU that holds memory worth
    competing for (:data:`OTHER_COMPUTE_RATIO` of the GPU for a compute process, or an
    unknown amount; :data:`OTHER_GRAPHICS_RATIO` for a graphics client): a
    workstation's display server, or a process holding nothing, beside one training
    job does not make the job a runaway. A process alone on its GPU is using
    what it was given, so it is never runaway by share. MIG parents are skipped: each
    process is confined to its instance, so a share of the whole board means nothing.

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
    others = {p.pid for p in gpu.processes if p.pid != process.pid and _competes(p, total)}
    if not others:
        return None
    pids = others | {process.pid}
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
