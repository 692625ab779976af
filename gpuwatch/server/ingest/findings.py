"""The one place ingest calls the detectors, and how their findings become events.

Per snapshot, on every readable GPU whose processes are visible: ``detect_orphan`` and
``detect_share`` per process, ``detect_unattributed`` per GPU. ``detect_idle`` and
``detect_leak`` need a trend, so they run only when a process's downsampling bucket
closes (once per ``sample_interval_seconds``), over its coarse samples of the last
``idle_window_seconds`` and ``leak_min_duration_seconds`` respectively (plus two
intervals of slack), read from its packed recent window (processes/window.py);
``detect_filling`` likewise when a GPU's bucket closes, over the GPU's window and
those of its processes.

Precedence, per process (docs/detection.md): ``orphaned`` > ``runaway`` > ``idle``. At
most one of the three is open for a lifetime at a time, so every byte it holds is
counted once in fleet totals: a dead PID is orphaned, not also idle or runaway; an
idle holder that grows or hogs a shared GPU is runaway. A verdict of higher rank
closes the lower ones at once, not at the next bucket close.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace

from gpuwatch.detectors import (
    Finding,
    Sample,
    detect_filling,
    detect_idle,
    detect_leak,
    detect_orphan,
    detect_share,
    detect_unattributed,
)
from gpuwatch.server.events.book import Condition, EventBook
from gpuwatch.server.ingest.state import GpuRow, LifetimeRow
from gpuwatch.server.processes import window
from gpuwatch.settings import ServerSettings
from gpuwatch.snapshot import Gpu, GpuProcess

# Per-process slots, one per event kind (so one open event per process and kind);
# closing a lifetime clears all of them. The runaway slot is fed by two rules: share,
# checked every snapshot, and leak, checked when a bucket closes; an open leak stands
# until a bucket close says otherwise.
PROCESS_SLOTS = ("orphan", "runaway", "idle")


def lifetime_key(slot: str, lifetime: LifetimeRow) -> str:
    return f"{slot}:lt{lifetime.id}"


def gpu_key(slot: str, gpu: GpuRow) -> str:
    return f"{slot}:gpu{gpu.id}"


def trend_window_seconds(settings: ServerSettings) -> float:
    """How far back the recent windows reach, in seconds: the idle window, and for the
    growth detectors their own window and as much again before it. What lies before
    the growth window is the level a verdict must rise past (detectors.growth.new_height),
    so a cycle longer than the window, climbing back to its last top, is not a leak."""
    return max(settings.idle_window_seconds, 2 * settings.leak_min_duration_seconds)


def check_process(
    book: EventBook,
    *,
    process: GpuProcess,
    gpu: Gpu,
    gpu_row: GpuRow,
    lifetime: LifetimeRow,
    settings: ServerSettings,
    at: float,
) -> None:
    """Run the per-snapshot process detectors and reconcile their events.

    A process the agent cannot see this time (``alive`` and not ``visible``) is judged by
    nothing, but that says nothing either: its PID may be hidden, or gone and not yet
    confirmed dead (the agent confirms a PID missing from ``/proc`` at its next poll, so
    its first snapshot after a restart lists a known dead PID so). An open orphaned
    verdict on it stands as it is, as do the verdicts it outranks; closing it split one
    dead PID's event in two at every agent restart, and restarted the wait of whatever
    reads it (the fleet's orphaned memory, the alert rules' ``held_for``).
    """
    orphan_key = lifetime_key("orphan", lifetime)
    if process.alive and not process.visible and book.is_open(orphan_key):
        return
    orphan = detect_orphan(process)
    _reconcile(book, "orphan", orphan, gpu_row, lifetime, at)
    runaway = lifetime_key("runaway", lifetime)
    if orphan is not None:
        book.clear(runaway, at=at)
    elif book.open_reason(runaway) != "leak":
        share = detect_share(process, gpu, share_ratio=settings.runaway_share_ratio)
        _reconcile(book, "runaway", share, gpu_row, lifetime, at)
    if orphan is not None or book.is_open(runaway):
        book.clear(lifetime_key("idle", lifetime), at=at)


def _memory_around(gpu: Gpu, pid: int) -> tuple[int | None, int | None]:
    """The total and free memory a process on ``gpu`` can grow into: its MIG
    instance's where it runs in one (a leak in a 10 GiB instance fills it in minutes,
    not when the whole board is full: "9.5 h" was said of one full in 37 min), else
    the GPU's."""
    instance = next((p.gpu_instance_id for p in gpu.processes if p.pid == pid), None)
    mig = next((m for m in gpu.mig_instances if m.gpu_instance_id == instance), None)
    if instance is None or mig is None or mig.memory_total_bytes is None:
        return gpu.memory_total_bytes, gpu.memory_free_bytes
    used = mig.memory_used_bytes
    return mig.memory_total_bytes, None if used is None else mig.memory_total_bytes - used


def check_trend(
    book: EventBook,
    *,
    recent: bytes,
    newest: Sample,
    gpu: Gpu,
    gpu_row: GpuRow,
    lifetime: LifetimeRow,
    settings: ServerSettings,
    at: float,
    push_interval: float | None = None,
) -> None:
    """Run the trend detectors on a lifetime's recent window (whose last sample is
    ``newest``, the bucket that just closed) and reconcile their events. ``push_interval``
    is the host's agent's (None: ``agent_push_interval_seconds``).

    Each detector is skipped when a cheap necessary condition already rules its
    finding out (the result would be None), so most lifetimes decode only the part
    of their window the leak detector reads.
    """
    interval = settings.sample_interval_seconds
    # Consecutive coarse samples are one interval apart, or one push apart when the
    # agent reports less often; two of those without a sample is a gap in evidence.
    max_gap = 2 * max(interval, push_interval or settings.agent_push_interval_seconds)
    orphaned = book.is_open(lifetime_key("orphan", lifetime))
    runaway = lifetime_key("runaway", lifetime)
    leak = None
    if not orphaned and _leak_possible(book, recent, newest, lifetime, settings=settings, at=at):
        total, free = _memory_around(gpu, lifetime.pid)
        leak = detect_leak(
            window.samples_since(recent, _leak_since(settings, at)),
            now=at,
            gpu_total_bytes=total,
            gpu_free_bytes=free,
            min_slope_bytes_per_second=settings.leak_min_slope_bytes_per_second,
            min_duration_seconds=settings.leak_min_duration_seconds,
            already_open=book.open_reason(runaway) == "leak",
            held_before_bytes=window.highest_floor_before(recent, _leak_since(settings, at)),
        )
    if leak is not None:
        _reconcile(book, "runaway", leak, gpu_row, lifetime, at)
    elif book.open_reason(runaway) == "leak":
        # The leak ended; if the process also hogs a shared GPU, the next snapshot's
        # share check opens that as a new runaway event.
        book.clear(runaway, at=at)
    idle = None
    # An idle bucket needs every poll in it observed at zero SM, so a bucket run of
    # window length implies a poll-level run (idle_since) of at least window - interval;
    # and a holder seen busy at this very poll (idle_since None) is not called idle.
    if (
        not orphaned
        and not book.is_open(runaway)
        and lifetime.idle_since is not None
        and at - lifetime.idle_since > settings.idle_window_seconds - interval
    ):
        idle = detect_idle(
            window.samples_since(recent, at - settings.idle_window_seconds - 2 * interval),
            now=at,
            window_seconds=settings.idle_window_seconds,
            min_bytes=settings.idle_min_bytes,
            max_gap_seconds=max_gap,
        )
    _reconcile(book, "idle", idle, gpu_row, lifetime, at)


def suspend_trends(book: EventBook, lifetimes: Sequence[LifetimeRow], *, at: float) -> None:
    """End the idle and leak verdicts of ``lifetimes``, on a GPU that is lost: "no
    activity for an hour" and "still growing" need observations it cannot give, and
    fleet totals would keep counting their bytes."""
    for lifetime in lifetimes:
        book.clear(lifetime_key("idle", lifetime), at=at)
        runaway = lifetime_key("runaway", lifetime)
        if book.open_reason(runaway) == "leak":
            book.clear(runaway, at=at)


def _leak_since(settings: ServerSettings, at: float) -> float:
    return at - settings.leak_min_duration_seconds - 2 * settings.sample_interval_seconds


def _leak_possible(
    book: EventBook,
    recent: bytes,
    newest: Sample,
    lifetime: LifetimeRow,
    *,
    settings: ServerSettings,
    at: float,
) -> bool:
    """False only when ``detect_leak`` is certain to find nothing (and no leak event is
    open that it would have to close)."""
    if book.open_reason(lifetime_key("runaway", lifetime)) == "leak":
        return True
    # Samples exist only since the lifetime began: a younger one cannot span the window.
    if at - lifetime.first_seen_at + settings.sample_interval_seconds < (
        settings.leak_min_duration_seconds
    ):
        return False
    # Each quarter's floor must exceed the one before, so the newest sample (which is in
    # the last quarter) must be above the window's floor: flat memory is no leak.
    floor = window.floor_since(recent, _leak_since(settings, at))
    return newest.used_bytes is None or floor is None or newest.used_bytes > floor


def _unattributed_unknown_this_poll(gpu: Gpu) -> bool:
    """The agent could not give this poll's figure (its two process lists differed, or a
    process's memory was withheld), on a GPU where the figure is a signal at all: not
    masked (see ``detect_unattributed``). A leaked context stays leaked meanwhile, and
    closing its event at every such poll kept it from ever lasting to its alert."""
    return (
        gpu.unattributed_bytes is None
        and gpu.processes_visible
        and not gpu.coherent_memory
        and not gpu.mig_instances
        and not gpu.lost
        and gpu.read_error is None
    )


def check_gpu(
    book: EventBook, *, gpu: Gpu, gpu_row: GpuRow, settings: ServerSettings, at: float
) -> None:
    """GPU-level conditions: unattributed memory, and a GPU fallen off the bus.

    Unattributed memory opens its event only when two consecutive snapshots show it:
    the agent reads the process list and the GPU's memory in separate NVML calls, and a
    large free between them makes one snapshot's difference a false alarm.
    """
    finding = detect_unattributed(gpu, min_bytes=settings.unattributed_min_bytes)
    key = gpu_key("unattributed", gpu_row)
    if finding is None:
        # One inconsistent read says nothing either way: the event stands as it is.
        if not _unattributed_unknown_this_poll(gpu):
            gpu_row.unattributed_since = None
            book.clear(key, at=at)
    elif gpu_row.unattributed_since is None or gpu_row.unattributed_since >= at:
        gpu_row.unattributed_since = at
    else:
        book.observe(key, _condition(finding, gpu_row), at=at)
    lost_key = gpu_key("gpu_lost", gpu_row)
    if gpu.lost:
        book.observe(
            lost_key,
            Condition(
                kind="gpu_lost",
                reason="gpu_is_lost",
                summary=f"GPU {gpu.index} ({gpu.uuid}) has fallen off the bus",
                gpu_uuid=gpu.uuid,
                gpu_index=gpu.index,
            ),
            at=at,
        )
    elif book.clear(lost_key, at=at):
        book.record_point(
            gpu_key("gpu_back", gpu_row),
            Condition(
                kind="gpu_back",
                reason="gpu_back",
                summary=f"GPU {gpu.index} ({gpu.uuid}) is readable again",
                gpu_uuid=gpu.uuid,
                gpu_index=gpu.index,
            ),
            at=at,
        )


def check_filling(
    book: EventBook,
    *,
    recent: bytes,
    gpu: Gpu,
    gpu_row: GpuRow,
    lifetimes: list[tuple[LifetimeRow, bytes | None]],
    settings: ServerSettings,
    at: float,
) -> None:
    """Run the filling-up detector on a GPU's recent window (its bucket just closed)
    and reconcile its event; culprits are named from their lifetimes."""
    finding = None
    masked = gpu.lost or gpu.read_error is not None or bool(gpu.mig_instances)
    if not masked and gpu.memory_total_bytes:
        since = _leak_since(settings, at)
        by_pid = {lt.pid: lt for lt, _ in lifetimes}
        finding = detect_filling(
            window.samples_since(recent, since),
            now=at,
            total_bytes=gpu.memory_total_bytes,
            free_bytes=gpu.memory_free_bytes,
            horizon_seconds=settings.filling_horizon_seconds,
            min_duration_seconds=settings.leak_min_duration_seconds,
            min_slope_bytes_per_second=settings.leak_min_slope_bytes_per_second,
            processes=_Windows({lt.pid: blob for lt, blob in lifetimes}, since),
            already_open=book.is_open(gpu_key("filling_up", gpu_row)),
            held_before_bytes=window.highest_floor_before(
                recent, since, since=_workload_since(lifetimes)
            ),
            now_bytes=gpu.memory_used_bytes,
        )
        if finding is not None:
            finding = _name_culprits(finding, by_pid)
    key = gpu_key("filling_up", gpu_row)
    if finding is None:
        book.clear(key, at=at)
    else:
        book.observe(key, _condition(finding, gpu_row), at=at)


def _workload_since(lifetimes: list[tuple[LifetimeRow, bytes | None]]) -> float:
    """Since when the GPU has held the processes it holds now (the newest one's first
    sighting; 0 without any). What it held before that was another workload's: a job
    that filled the GPU and ended says nothing of how far the next one will go, and
    judging the next against its height held back the next one's warning until that
    height left the history."""
    return max((lifetime.first_seen_at for lifetime, _ in lifetimes), default=0.0)


class _Windows(Mapping[int, Sequence[Sample]]):
    """Each PID's samples since ``since``, decoded from its packed window when read.
    The filling-up detector reads them only to rank the culprits of a verdict, and
    decoding the windows of every process on the GPU at each bucket close, when almost
    none is filling up, was 6% of the ingest writer thread's samples (bench/writer.py)."""

    def __init__(self, blobs: dict[int, bytes | None], since: float) -> None:
        self._blobs = blobs
        self._since = since

    def __getitem__(self, pid: int) -> Sequence[Sample]:
        return window.samples_since(self._blobs[pid], self._since)

    def __iter__(self) -> Iterator[int]:
        return iter(self._blobs)

    def __len__(self) -> int:
        return len(self._blobs)


def _name_culprits(finding: Finding, by_pid: dict[int, LifetimeRow]) -> Finding:
    """The detector ranks culprits by pid; say whose they are (what alerts print)."""
    culprits = []
    for culprit in finding.evidence.get("culprits", []):  # type: ignore[attr-defined]
        lifetime = by_pid.get(culprit["pid"])
        if lifetime is not None:
            culprit = {
                **culprit,
                # Which process it is: a PID alone is not, once the kernel reuses it
                # (the alert rules match the current holder by this).
                "lifetime_id": lifetime.id,
                "user": lifetime.user,
                "command": lifetime.command or lifetime.name,
                "memory_bytes": lifetime.current_bytes,
                "container_id": lifetime.container_id,
                "pod_uid": lifetime.pod_uid,
                "slurm_job_id": lifetime.slurm_job_id,
            }
        culprits.append(culprit)
    return replace(finding, evidence={**finding.evidence, "culprits": culprits})


def clear_lifetime(book: EventBook, lifetime: LifetimeRow, *, at: float) -> None:
    """A lifetime ended: the conditions about it end with it."""
    for slot in PROCESS_SLOTS:
        book.clear(lifetime_key(slot, lifetime), at=at)


def _reconcile(
    book: EventBook,
    slot: str,
    finding: Finding | None,
    gpu_row: GpuRow,
    lifetime: LifetimeRow,
    at: float,
) -> None:
    key = lifetime_key(slot, lifetime)
    if finding is None:
        book.clear(key, at=at)
    else:
        book.observe(key, _condition(finding, gpu_row, lifetime), at=at)


def _condition(finding: Finding, gpu: GpuRow, lifetime: LifetimeRow | None = None) -> Condition:
    return Condition(
        kind=finding.kind,
        reason=finding.reason,
        summary=finding.summary,
        held_bytes=finding.held_bytes,
        evidence=dict(finding.evidence),
        gpu_uuid=gpu.uuid,
        gpu_index=gpu.gpu_index,
        lifetime_id=None if lifetime is None else lifetime.id,
        pid=None if lifetime is None else lifetime.pid,
        user=None if lifetime is None else lifetime.user,
    )
