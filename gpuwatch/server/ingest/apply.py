"""Apply one snapshot to a host's state: GPUs, process lifetimes, coarse samples, events.

Rules worth knowing:

* Lifetimes are reconciled only on GPUs that were read and whose processes are
  visible. A lost GPU, one with a ``read_error``, or one missing from the snapshot says
  nothing about its processes, so their lifetimes stay open, untouched.
* A new ``boot_id`` ends every open lifetime of the host at its last observation:
  no process survives a reboot.
* Who a process was (name, command, user, uid, container, pod, job) is never
  forgotten: an unknown value (``None``) in a later snapshot leaves the known one
  stored. A process listed without a start time (its PID is dead or hidden: ``/proc``
  has nothing left to read) is a new lifetime, keyed ``(gpu, pid, None)``; it takes
  the identity of the lifetime that held the same PID on the same GPU until now (open,
  or ended within the reopen window), because NVML's context is that process's: the
  ``dead_pid`` event names whose process died. A process with a start time is its own
  and inherits nothing (a reused PID is another process).
* Downsampling: a bucket is ``[phase + k * interval, phase + (k + 1) * interval)`` of
  snapshot time, where ``phase`` is the host's own (:func:`bucket_phase`). Each
  lifetime and GPU accumulates the bucket it is in (process: lowest and highest
  memory, busiest SM ratio; GPU: lowest and highest used, highest unattributed) and
  writes it as one sample row when a snapshot falls into a later bucket, or when the
  lifetime ends. Bucket rows are stamped with the bucket's start, so a run of idle
  buckets can overstate idleness by less than one interval. Readers use those stored
  starts; nothing recomputes a bucket boundary from the clock.
* Why a phase per host: closing a bucket is the heavy part of a push (a sample row
  per GPU and process, the windows rewritten, the trend detectors run). With buckets
  on the wall-clock minute every host closed its buckets in the same push interval,
  and for 15 s in every 60 the server did four times its average work (bench/README.md,
  load). Phases spread evenly over the interval spread that work evenly too.
"""

from __future__ import annotations

import math
from typing import Any, TypeVar

from gpuwatch.detectors import Sample
from gpuwatch.detectors.buckets import bucket_start
from gpuwatch.server.ingest import findings
from gpuwatch.server.ingest.state import GpuRow, HostState, Identity, LifetimeRow
from gpuwatch.server.processes import window
from gpuwatch.settings import ServerSettings
from gpuwatch.snapshot import UNKNOWN_GPU_UUID_PREFIX, Gpu, GpuProcess, HostSnapshot

N = TypeVar("N", int, float)
# A lifetime whose bucket just closed, with its GPU and the closed bucket's sample.
TrendDue = tuple[Gpu, GpuRow, LifetimeRow, Sample]
# A GPU whose bucket just closed, and the closed bucket's sample.
FillingDue = tuple[Gpu, GpuRow, Sample]


def apply_snapshot(
    state: HostState,
    snapshot: HostSnapshot,
    *,
    settings: ServerSettings,
    at: float | None = None,
) -> None:
    """Advance ``state`` by one snapshot newer than any applied before, observed at
    ``at`` (default its ``collected_at``; ingest passes it clamped to the server's
    clock, see service.py)."""
    at = snapshot.collected_at if at is None else at
    snapshot = _named_as_before(state, snapshot)
    host = state.host
    if host.boot_id is not None and snapshot.boot_id != host.boot_id:
        end_all_lifetimes(state)
    host.agent_id = snapshot.agent_id
    host.boot_id = snapshot.boot_id
    host.last_sequence = snapshot.sequence
    host.last_seen_at = at
    host.driver_version = snapshot.driver_version
    host.cuda_driver_version = snapshot.cuda_driver_version
    host.pid_namespace_isolated = snapshot.pid_namespace_isolated
    host.fake = snapshot.fake

    bucket = host_bucket(at, host_id=host.id, interval=settings.sample_interval_seconds)
    filling_due: list[FillingDue] = []
    gpu_rows: dict[str, GpuRow] = {}
    for gpu in snapshot.gpus:
        gpu_rows[gpu.uuid], closed = _upsert_gpu(state, gpu, bucket=bucket, at=at)
        if closed is not None:
            filling_due.append((gpu, gpu_rows[gpu.uuid], closed))
    reconciled = [
        gpu
        for gpu in snapshot.gpus
        if not gpu.lost and gpu.read_error is None and gpu.processes_visible
    ]
    _open_new_lifetimes(state, reconciled, gpu_rows, settings=settings, at=at)
    for gpu in snapshot.gpus:
        findings.check_gpu(
            state.events, gpu=gpu, gpu_row=gpu_rows[gpu.uuid], settings=settings, at=at
        )
    # Each GPU's open lifetimes, in one pass (not one pass over the host's per GPU).
    on_gpu: dict[int, list[LifetimeRow]] = {}
    for (gpu_id, _, _), lifetime in state.open.items():
        on_gpu.setdefault(gpu_id, []).append(lifetime)
    for gpu in snapshot.gpus:
        if gpu.lost:
            # Fallen off the bus: nothing on it can be observed until it is back, so
            # verdicts that need current evidence (idle, a leak) end, as filling_up does;
            # the lifetimes stay open. (One poll's read error is only a gap: the idle
            # run bridges it, and ending the verdict there would split its event.)
            findings.suspend_trends(state.events, on_gpu.get(gpu_rows[gpu.uuid].id, []), at=at)
    trend_due: list[TrendDue] = []
    for gpu in reconciled:
        gpu_row = gpu_rows[gpu.uuid]
        trend_due += _reconcile_processes(
            state,
            gpu,
            gpu_row,
            on_gpu.get(gpu_row.id, []),
            settings=settings,
            bucket=bucket,
            at=at,
        )
    _check_trends(state, trend_due, settings=settings, at=at)
    # After the trends: the culprit ranking reads the process windows they just extended.
    _check_filling(state, filling_due, settings=settings, at=at)


def _reconcile_processes(
    state: HostState,
    gpu: Gpu,
    gpu_row: GpuRow,
    open_on_gpu: list[LifetimeRow],
    *,
    settings: ServerSettings,
    bucket: float,
    at: float,
) -> list[TrendDue]:
    """Update the lifetimes of the GPU's listed processes and end the unlisted ones of
    ``open_on_gpu``; return the lifetimes whose bucket closed (their trend check is due)."""
    due: list[TrendDue] = []
    listed: set[int] = set()
    for process in gpu.processes:
        lifetime = state.open[(gpu_row.id, process.pid, process.start_time)]
        listed.add(lifetime.id)
        closed = _observe(lifetime, process, bucket=bucket, at=at, state=state)
        if closed is not None:
            due.append((gpu, gpu_row, lifetime, closed))
        state.touch(lifetime)
        findings.check_process(
            state.events,
            process=process,
            gpu=gpu,
            gpu_row=gpu_row,
            lifetime=lifetime,
            settings=settings,
            at=at,
        )
    for lifetime in [lt for lt in open_on_gpu if lt.id not in listed]:
        _end(state, lifetime, at=at)
    return due


def _named_as_before(state: HostState, snapshot: HostSnapshot) -> HostSnapshot:
    """``snapshot`` with each GPU the agent could not name (lost or hung since the agent
    started, so never read: ``GPU-unknown-<index>``) given the UUID of the GPU this host
    last had at its index. Without it a board that fell off the bus while its agent
    restarted was listed as a new GPU beside itself, and its ``gpu_lost`` event named
    neither."""
    if not any(g.uuid.startswith(UNKNOWN_GPU_UUID_PREFIX) for g in snapshot.gpus):
        return snapshot
    named = {g.uuid for g in snapshot.gpus}
    gpus = []
    for gpu in snapshot.gpus:
        if gpu.uuid.startswith(UNKNOWN_GPU_UUID_PREFIX):
            known = [
                row
                for row in state.gpus.values()
                if row.gpu_index == gpu.index
                and row.uuid not in named
                and not row.uuid.startswith(UNKNOWN_GPU_UUID_PREFIX)
            ]
            if known:
                row = max(known, key=lambda r: r.last_seen_at)
                gpu = gpu.model_copy(update={"uuid": row.uuid, "name": gpu.name or row.name})
                named.add(row.uuid)
        gpus.append(gpu)
    return snapshot.model_copy(update={"gpus": gpus})


def _upsert_gpu(
    state: HostState, gpu: Gpu, *, bucket: float, at: float
) -> tuple[GpuRow, Sample | None]:
    """Update (or insert) the GPU's row; return it and the sample of a bucket it closed
    (``bucket``: the start of the bucket ``at`` falls in)."""
    closed = None
    row = state.gpus.get(gpu.uuid)
    if row is None:
        row = state.add_gpu(
            {
                "uuid": gpu.uuid,
                "gpu_index": gpu.index,
                "name": gpu.name,
                "memory_total_bytes": gpu.memory_total_bytes,
                "memory_used_bytes": None,
                "memory_free_bytes": None,
                "unattributed_bytes": None,
                "utilization_ratio": None,
                "lost": gpu.lost,
                "read_error": gpu.read_error,
                "last_seen_at": at,
                "bucket_start_at": None,
                "bucket_used_bytes": None,
                "bucket_unattributed_bytes": None,
                "bucket_low_bytes": None,
                "unattributed_since": None,
                "ecc_uncorrected_volatile": None,
                "xid_errors": None,
                "xid_last_code": None,
                "xid_seen_at": None,
                "throttle_reasons": None,
                "remap_pending": None,
                "remap_failure": None,
            }
        )
        state.record_gpu_index(row, since=at)
    elif row.gpu_index != gpu.index:
        # History answers by the index of then: keep when this one began.
        row.gpu_index = gpu.index
        state.record_gpu_index(row, since=at)
    row.name = gpu.name or row.name
    row.lost = gpu.lost
    row.read_error = gpu.read_error
    row.last_seen_at = at
    if not gpu.lost and gpu.read_error is None:
        # The total does not change; keep the last known one through a lost poll.
        row.memory_total_bytes = gpu.memory_total_bytes or row.memory_total_bytes
        row.memory_used_bytes = gpu.memory_used_bytes
        row.memory_free_bytes = gpu.memory_free_bytes
        row.unattributed_bytes = gpu.unattributed_bytes
        row.utilization_ratio = gpu.utilization_ratio
        _note_health(row, gpu, at=at)
        if row.bucket_start_at is not None and bucket > row.bucket_start_at:
            closed = state.add_gpu_sample(row)
            row.bucket_start_at = None
        if row.bucket_start_at is None:
            row.bucket_start_at = bucket
            row.bucket_used_bytes = row.bucket_low_bytes = gpu.memory_used_bytes
            row.bucket_unattributed_bytes = gpu.unattributed_bytes
        else:
            row.bucket_used_bytes = _max(row.bucket_used_bytes, gpu.memory_used_bytes)
            row.bucket_low_bytes = _min(row.bucket_low_bytes, gpu.memory_used_bytes)
            row.bucket_unattributed_bytes = _max(
                row.bucket_unattributed_bytes, gpu.unattributed_bytes
            )
    state.touch(row)
    return row, closed


def _note_health(row: GpuRow, gpu: Gpu, *, at: float) -> None:
    """Keep the GPU's health readings; note when its Xid count rose (a new error)."""
    old, new = row.xid_errors, gpu.xid_errors
    # The count is the agent's since it started: a lower one means it restarted, and
    # anything it has counted since is new.
    if new is not None and (new > (old or 0) or (old is not None and 0 < new < old)):
        row.xid_seen_at = at
    row.xid_errors = gpu.xid_errors
    row.xid_last_code = gpu.xid_last_code
    row.ecc_uncorrected_volatile = gpu.ecc_uncorrected_volatile
    reasons = gpu.throttle_reasons
    row.throttle_reasons = None if reasons is None else ",".join(sorted(reasons))
    row.remap_pending = gpu.remapped_rows_pending
    row.remap_failure = gpu.remapped_rows_failure


def _open_new_lifetimes(
    state: HostState,
    gpus: list[Gpu],
    gpu_rows: dict[str, GpuRow],
    *,
    settings: ServerSettings,
    at: float,
) -> None:
    """Make sure every listed process has an open lifetime: reopen or insert."""
    new: dict[Identity, GpuProcess] = {}
    for gpu in gpus:
        gpu_id = gpu_rows[gpu.uuid].id
        for process in gpu.processes:
            identity = (gpu_id, process.pid, process.start_time)
            if identity not in state.open:
                new[identity] = process
    if not new:
        return
    # Same pid and start time is the same process: reopen its lifetime (a poll that
    # missed it, or a new boot id listing it again), never insert a second row of the
    # identity (the table's unique key; that refused the whole batch). This includes
    # lifetimes ended earlier in this same request, which only the state knows about.
    # Without a start time only a recent close is trusted to be the same.
    push_interval = state.host.push_interval_seconds or settings.agent_push_interval_seconds
    reopen_after = at - 2 * max(settings.sample_interval_seconds, push_interval)
    closed = state.closed_matches(new)
    for lifetime in closed:
        identity = lifetime.identity
        if identity not in new or identity in state.open:
            continue
        if lifetime.start_time is None and (lifetime.ended_at or 0.0) < reopen_after:
            continue
        state.reopen(lifetime)
        del new[identity]
    recent = [lt for lt in closed if (lt.ended_at or 0.0) >= reopen_after]
    state.add_lifetimes(
        [
            _new_lifetime(
                gpu_id,
                process,
                at=at,
                known=(
                    _predecessor(state, recent, gpu_id, process)
                    if process.start_time is None
                    else None
                ),
            )
            for (gpu_id, _, _), process in new.items()
        ]
    )


def _predecessor(
    state: HostState, recent: list[LifetimeRow], gpu_id: int, process: GpuProcess
) -> LifetimeRow | None:
    """The lifetime whose identity a process listed without a start time takes: the one
    that held its PID on its GPU until now, open (listed until this snapshot) before one
    ended recently (``recent``), the latest of each (module docstring)."""
    same = [lt for lt in state.open.values() if lt.gpu_id == gpu_id and lt.pid == process.pid]
    if same:
        return max(same, key=lambda lt: lt.last_seen_at)
    ended = [lt for lt in recent if lt.gpu_id == gpu_id and lt.pid == process.pid]
    return max(ended, key=lambda lt: lt.ended_at or 0.0) if ended else None


def _identity_of(process: GpuProcess) -> dict[str, Any]:
    """The lifetime columns that say who a process is: where one is unknown (None), the
    value stored or inherited stays (module docstring)."""
    owner = process.owner
    return {
        "name": process.name,
        "command": process.command,
        "user": owner.user,
        "uid": owner.uid,
        "container_id": owner.container_id,
        "pod_uid": owner.pod_uid,
        "slurm_job_id": owner.slurm_job_id,
    }


def _new_lifetime(
    gpu_id: int, process: GpuProcess, *, at: float, known: LifetimeRow | None = None
) -> dict[str, Any]:
    """A new lifetime's row; ``known``: the lifetime whose identity fills what
    ``process`` does not say (:func:`_predecessor`)."""
    identity = _identity_of(process)
    if known is not None:
        for column, value in identity.items():
            if value is None:
                identity[column] = getattr(known, column)
    return {
        "gpu_id": gpu_id,
        "pid": process.pid,
        "start_time": process.start_time,
        "kind": process.kind,
        **identity,
        "orphaned": process.orphaned,
        "first_seen_at": at,
        "last_seen_at": at,
        "ended_at": None,
        "current_bytes": process.used_bytes,
        "peak_bytes": process.used_bytes,
        "sm_ratio": process.sm_ratio,
        "idle_since": at if process.sm_ratio == 0 else None,
        "bucket_start_at": None,
        "bucket_min_bytes": None,
        "bucket_max_bytes": None,
        "bucket_max_sm_ratio": None,
    }


def _observe(
    lifetime: LifetimeRow,
    process: GpuProcess,
    *,
    bucket: float,
    at: float,
    state: HostState,
) -> Sample | None:
    """Update a lifetime from its process; return the sample of a bucket it closed."""
    lifetime.kind = process.kind
    for column, value in _identity_of(process).items():
        if value is not None:  # a process that exits mid-read leaves a half-read identity
            setattr(lifetime, column, value)
    lifetime.orphaned = process.orphaned
    lifetime.last_seen_at = at
    lifetime.current_bytes = process.used_bytes
    lifetime.peak_bytes = _max(lifetime.peak_bytes, process.used_bytes)
    lifetime.sm_ratio = process.sm_ratio
    # Unknown activity (None) breaks an idle run: idleness must be observed.
    if process.sm_ratio == 0:
        lifetime.idle_since = lifetime.idle_since if lifetime.idle_since is not None else at
    else:
        lifetime.idle_since = None
    closed = None
    if lifetime.bucket_start_at is not None and bucket > lifetime.bucket_start_at:
        closed = state.add_process_sample(lifetime)
        lifetime.bucket_start_at = None
    if lifetime.bucket_start_at is None:
        lifetime.bucket_start_at = bucket
        lifetime.bucket_min_bytes = process.used_bytes
        lifetime.bucket_max_bytes = process.used_bytes
        lifetime.bucket_max_sm_ratio = process.sm_ratio
    else:
        lifetime.bucket_min_bytes = _min(lifetime.bucket_min_bytes, process.used_bytes)
        lifetime.bucket_max_bytes = _max(lifetime.bucket_max_bytes, process.used_bytes)
        lifetime.bucket_max_sm_ratio = _busiest(lifetime.bucket_max_sm_ratio, process.sm_ratio)
    return closed


def _check_trends(
    state: HostState,
    due: list[TrendDue],
    *,
    settings: ServerSettings,
    at: float,
) -> None:
    """Append each closed bucket to its lifetime's window and run the trend detectors."""
    if not due:
        return
    keep_after = at - findings.trend_window_seconds(settings) - 2 * settings.sample_interval_seconds
    windows = state.windows(lifetime.id for _, _, lifetime, _ in due)
    for gpu, gpu_row, lifetime, sample in due:
        blob = window.append(windows[lifetime.id], sample, keep_after=keep_after)
        state.set_window(lifetime.id, blob)
        findings.check_trend(
            state.events,
            recent=blob,
            newest=sample,
            gpu=gpu,
            gpu_row=gpu_row,
            lifetime=lifetime,
            settings=settings,
            at=at,
            push_interval=state.host.push_interval_seconds,
        )


def _check_filling(
    state: HostState, due: list[FillingDue], *, settings: ServerSettings, at: float
) -> None:
    """Append each closed GPU bucket to the GPU's window and run the filling-up check
    over it and the windows of the GPU's open lifetimes (the culprit candidates)."""
    if not due:
        return
    keep_after = at - findings.trend_window_seconds(settings) - 2 * settings.sample_interval_seconds
    for gpu, gpu_row, sample in due:
        blob = window.append(state.gpu_window(gpu_row.id), sample, keep_after=keep_after)
        state.set_gpu_window(gpu_row.id, blob)
        on_gpu = [lt for ident, lt in state.open.items() if ident[0] == gpu_row.id]
        windows = state.windows(lt.id for lt in on_gpu)
        findings.check_filling(
            state.events,
            recent=blob,
            gpu=gpu,
            gpu_row=gpu_row,
            lifetimes=[(lt, windows[lt.id]) for lt in on_gpu],
            settings=settings,
            at=at,
        )


def _end(state: HostState, lifetime: LifetimeRow, *, at: float) -> None:
    if lifetime.bucket_start_at is not None:
        state.add_process_sample(lifetime)
        lifetime.bucket_start_at = None
        lifetime.bucket_min_bytes = lifetime.bucket_max_bytes = None
        lifetime.bucket_max_sm_ratio = None
    state.end(lifetime, at=at)
    findings.clear_lifetime(state.events, lifetime, at=at)


def end_all_lifetimes(state: HostState) -> int:
    """End every open lifetime of the host at its own last observation (a reboot, or
    a host gone silent); return how many ended."""
    ending = list(state.open.values())
    for lifetime in ending:
        _end(state, lifetime, at=lifetime.last_seen_at)
    return len(ending)


# The golden ratio's fraction: host ids are consecutive integers, and multiples of it
# modulo 1 are the most evenly spread sequence there is, for any number of hosts.
_SPREAD = (math.sqrt(5) - 1) / 2


def bucket_phase(host_id: int, interval: float) -> float:
    """The offset (seconds, in ``[0, interval)``) of the host's downsampling buckets
    from multiples of ``interval``: stable for the host, spread evenly over the fleet.

    Whole seconds, so bucket starts stay whole seconds when the interval is (the
    dashboard cuts chart columns by integer seconds); 0 for intervals under a second.
    """
    return float(math.floor((host_id * _SPREAD) % 1.0 * interval))


def host_bucket(at: float, *, host_id: int, interval: float) -> float:
    """Start (epoch s) of the host's bucket that holds ``at``."""
    phase = bucket_phase(host_id, interval)
    return bucket_start(at - phase, interval) + phase


def _busiest(a: float | None, b: float | None) -> float | None:
    """A bucket's SM activity from two polls: any activity wins; otherwise one unknown
    poll makes the bucket unknown, so only polls all observed at zero make it idle."""
    if (a or 0.0) > 0 or (b or 0.0) > 0:
        return max(a or 0.0, b or 0.0)
    return None if a is None or b is None else 0.0


# None is "unknown", never zero: it neither wins nor loses a comparison.
def _max(a: N | None, b: N | None) -> N | None:
    return b if a is None else a if b is None else max(a, b)


def _min(a: N | None, b: N | None) -> N | None:
    return b if a is None else a if b is None else min(a, b)
