"""Orphaned holders: GPU memory whose owner is dead, abandoned or no longer driven."""

from __future__ import annotations

from gpuwatch.detectors._format import format_bytes
from gpuwatch.detectors.types import Finding, FindingReason
from gpuwatch.snapshot import GpuProcess

_SUMMARIES: dict[FindingReason, str] = {
    "dead_pid": "process {pid} is gone but its GPU context still holds {held}",
    "jupyter_server_gone": "Jupyter kernel {pid} outlived its notebook server and holds {held}",
    "job_ended": "process {pid} of {job} lost its parent (the job step ended?) and holds {held}",
    "reparented": "process {pid} lost its parent (reparented to init) and holds {held}",
}


def detect_orphan(process: GpuProcess) -> Finding | None:
    """Return an ``orphaned`` finding for a process NVML lists whose owner is gone.

    Rules, most specific first:

    * ``dead_pid``: the agent can see the PID's namespace and the process is not alive,
      yet NVML still lists it (a context leaked by a crashed driver call or a zombie).
    * ``jupyter_server_gone``: a Jupyter kernel whose notebook server is no longer
      running; nobody can send it work, so its memory is stranded.
    * ``job_ended``: reparented, and the process belongs to a Slurm job or a Kubernetes
      pod. Our best local rule: batch steps are launched by the scheduler's step daemon
      (``slurmstepd``) or the container's init, so losing that parent means the step
      that owned it ended. The scheduler is the authority; this is evidence, not proof.
    * ``reparented``: the original parent exited and the process now hangs off init or
      a subreaper (the training run whose SSH shell died).

    A process that holds 0 bytes holds nothing worth reporting; ``used_bytes is None``
    (not readable) still reports, because the GPU context itself is held.
    """
    if process.used_bytes == 0:
        return None
    # visible=False means the agent runs in another PID namespace (a container without
    # hostPID): NVML reports host PIDs that the agent's /proc simply does not contain.
    # That proves nothing about the process, so it is not called dead.
    if not process.visible:
        return None
    reason = _reason(process)
    if reason is None:
        return None
    job = process.owner.slurm_job_id or process.owner.pod_uid
    job_label = f"Slurm job {job}" if process.owner.slurm_job_id else f"pod {job}"
    held = process.used_bytes
    return Finding(
        kind="orphaned",
        reason=reason,
        summary=_SUMMARIES[reason].format(
            pid=process.pid,
            held="an unknown amount" if held is None else format_bytes(held),
            job=job_label,
        ),
        held_bytes=held,
        evidence={
            "pid": process.pid,
            "ppid": process.ppid,
            "alive": process.alive,
            "orphaned": process.orphaned,
            "jupyter_server_alive": process.jupyter_server_alive,
            "slurm_job_id": process.owner.slurm_job_id,
            "pod_uid": process.owner.pod_uid,
        },
    )


def _reason(process: GpuProcess) -> FindingReason | None:
    if not process.alive:
        return "dead_pid"
    # None means the agent could not tell whether the server runs: no finding.
    if process.jupyter_kernel and process.jupyter_server_alive is False:
        return "jupyter_server_gone"
    if process.orphaned:
        if process.owner.slurm_job_id or process.owner.pod_uid:
            return "job_ended"
        return "reparented"
    return None
