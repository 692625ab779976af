"""The one place ingest calls the detectors, and how their findings become events.

Per snapshot, on every readable GPU whose processes are visible: ``detect_orphan`` and
``detect_share`` per process, ``detect_unattributed`` per GPU. ``detect_idle`` and
``detect_leak`` need a trend, so they run only when a process's downsampling bucket
closes (once per ``sample_interval_seconds``), over its coarse samples of the last
``idle_window_seconds`` and ``leak_min_duration_seconds`` respectively (plus two
intervals of slack), read from its packed recent window (processes/window.py).
"""

from __future__ import annotations

from gpuwatch.server.detectors import (
    Finding,
    Sample,
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

# Per-process detector slots; closing a lifetime clears all of them.
PROCESS_SLOTS = ("orphan", "share", "idle", "leak")


def lifetime_key(slot: str, lifetime: LifetimeRow) -> str:
    return f"{slot}:lt{lifetime.id}"


def gpu_key(slot: str, gpu: GpuRow) -> str:
    return f"{slot}:gpu{gpu.id}"


def trend_window_seconds(settings: ServerSettings) -> float:
    """How far back the idle and leak detectors look, in seconds."""
    return max(settings.idle_window_seconds, settings.leak_min_duration_seconds)


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
    """Run the per-snapshot process detectors and reconcile their events."""
    _reconcile(book, "orphan", detect_orphan(process), gpu_row, lifetime, at)
    share = detect_share(process, gpu, share_ratio=settings.runaway_share_ratio)
    _reconcile(book, "share", share, gpu_row, lifetime, at)


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
) -> None:
    """Run the trend detectors on a lifetime's recent window (whose last sample is
    ``newest``, the bucket that just closed) and reconcile their events.

    Each detector is skipped when a cheap necessary condition already rules its
    finding out (the result would be None), so most lifetimes decode only the part
    of their window the leak detector reads.
    """
    interval = settings.sample_interval_seconds
    # Consecutive coarse samples are one interval apart, or one push apart when the
    # agent reports less often; two of those without a sample is a gap in evidence.
    max_gap = 2 * max(interval, settings.agent_push_interval_seconds)
    idle = None
    # An idle bucket needs every poll in it observed at zero SM, so a bucket run of
    # window length implies a poll-level run (idle_since) of at least window - interval;
    # and a holder seen busy at this very poll (idle_since None) is not called idle.
    if (
        lifetime.idle_since is not None
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
    leak = None
    if _leak_possible(book, recent, newest, lifetime, settings=settings, at=at):
        leak = detect_leak(
            window.samples_since(recent, _leak_since(settings, at)),
            now=at,
            gpu_total_bytes=gpu.memory_total_bytes,
            gpu_free_bytes=gpu.memory_free_bytes,
            min_slope_bytes_per_second=settings.leak_min_slope_bytes_per_second,
            min_duration_seconds=settings.leak_min_duration_seconds,
        )
    _reconcile(book, "leak", leak, gpu_row, lifetime, at)


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
    if book.is_open(lifetime_key("leak", lifetime)):
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


def check_gpu(
    book: EventBook, *, gpu: Gpu, gpu_row: GpuRow, settings: ServerSettings, at: float
) -> None:
    """GPU-level conditions: unattributed memory, and a GPU fallen off the bus."""
    finding = detect_unattributed(gpu, min_bytes=settings.unattributed_min_bytes)
    key = gpu_key("unattributed", gpu_row)
    if finding is None:
        book.clear(key, at=at)
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
