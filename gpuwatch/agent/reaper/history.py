"""The agent's local activity history: enough to say "idle for the whole window" by itself.

Each poll adds one observation per process and GPU; the history keeps, per
``(GPU uuid, pid, start time)``, a short list of **runs**: stretches of consecutive
polls with the same activity (``idle``: SM known to be 0; ``active``: SM above 0;
``unknown``: NVML could not say) and the same host-CPU verdict. A run covers its whole
``[start, end]``: two polls join a run only when they are at most ``cover_seconds``
apart (1.5 poll intervals), so a missed poll, a failed poll or an agent restart leaves
a **gap** between runs. Gaps are unknown time, never idle (:func:`idle_evidence`).

Downsampling and bounds (docs/reaper.md, "History"):

* A process idle for a day is one run, whatever the poll interval: the history grows
  with *changes*, not with polls.
* Only what the idle verdict can use is kept. The verdict looks back from now while
  the process stays idle, so when a run ends in ``active`` or ``unknown``, everything
  before that run is dropped; a gap longer than ``max_gap_seconds`` drops everything
  before it too.
* At most ``max_runs`` runs per process and GPU (oldest dropped: a shorter history
  can only make a process *less* idle), runs older than ``history_seconds`` are
  dropped, and a process not seen for ``max_gap_seconds`` on a GPU the agent read is
  forgotten. On a GPU it cannot read (lost, an NVML error, no longer listed) nothing
  is seen, so nothing there is forgotten either: the track stays (its runs end at the
  last poll that read the GPU) and says that the process held memory there, which
  spares it for as long as the GPU cannot be read (:meth:`ProcessHistory.gpus_for`).

Measured by ``bench/reaper.py``: a day of 8 GPUs x 200 processes costs well under
10 MiB. The history lives in memory: an agent restart starts it afresh, so no
process is idle (for the reaper) until a full window after the restart.

Where NVML cannot give per-process activity (a failed
``nvmlDeviceGetProcessUtilization``), the whole GPU's figures stand in, but only in
one direction: a GPU whose kernels, video encoder or video decoder are busy makes the
poll ``active`` for every process on it; a GPU that reads 0 on all three makes it
``unknown``, never ``idle``. Those three figures are NVML's last sample period (1/6 s
to 1 s), not the time since the previous poll, so a 0 says nothing of the seconds
before it. MIG GPUs report neither; there a process is judged by the activity of the
GPU instance it runs in (GPM, Hopper and later: ``MigInstance.activity_ratio``, which
does cover the time since the previous poll): ``idle`` at 0, ``active`` above,
``unknown`` when it could not be read (an A100, an older driver, the agent's first
poll) or the process's instance is not known.

**Memory that grows is activity**: a poll where the process holds more than
:data:`MEMORY_GROWTH_BYTES` more than at its previous poll is ``active`` whatever its
engines read (a model being loaded by DMA, or GPUDirect Storage, shows no SM).

**Times** are the caller's (``observe(snapshot, at=...)``): the agent stamps each poll
with its steady clock (``CLOCK_BOOTTIME`` plus a fixed offset,
:func:`gpuwatch.agent.reaper.clock.steady_clock`), so a wall-clock step neither hides
polls nor stretches a run. A poll stamped earlier than the previous one (which a
steady clock never does) breaks the history: what came before is dropped, never
joined.

The agent serves it as JSON at ``GET /reaper/history``
(:mod:`gpuwatch.agent.reaper.served`); :mod:`gpuwatch.agent.reaper.evidence` turns
runs into the idle verdict.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal

from gpuwatch.agent.reaper.procfs import same_start
from gpuwatch.snapshot import Gpu, GpuProcess, HostSnapshot

Activity = Literal["idle", "active", "unknown"]

# More than this much growth of a process's memory between two polls is activity:
# an allocation (a copy engine or DMA filling it), even with every engine at 0. Two
# large pages, so that no page-granular accounting of an idle context counts.
MEMORY_GROWTH_BYTES = 4 * 2**20


@dataclass(slots=True)
class Run:
    """Consecutive polls of one process on one GPU with the same activity.

    Times are epoch seconds; the run covers all of ``[start, end]``. ``low_bytes`` and
    ``high_bytes`` are the least and most memory seen (``None``: not available in some
    poll), ``busiest_ratio`` the highest SM ratio, ``cpu_busy`` whether host CPU use
    was above the threshold (it is one value per run: a change starts a new run).
    """

    start: float
    end: float
    activity: Activity
    low_bytes: int | None
    high_bytes: int | None
    busiest_ratio: float = 0.0
    cpu_busy: bool = False


@dataclass(slots=True)
class _Track:
    gpu_index: int
    gpu_uuid: str
    pid: int
    start_time: float | None
    last_t: float
    last_cpu: float | None
    runs: list[Run]
    last_used: int | None = None


TrackKey = tuple[str, int, float | None]  # (GPU uuid, pid, process start time)


def classify(process: GpuProcess, gpu: Gpu) -> Activity:
    """One poll's activity for ``process`` on ``gpu`` (see the module docstring)."""
    return _verdict(activity_ratio(process, gpu))


def _verdict(ratio: float | None) -> Activity:
    if ratio is None:
        return "unknown"
    return "active" if ratio > 0 else "idle"


def activity_ratio(process: GpuProcess, gpu: Gpu) -> float | None:
    """The busy share (0..1) that judges ``process`` in this poll: its own busiest
    engine; else, on MIG, its instance's activity; else the whole GPU's, when that shows
    work (:func:`whole_gpu_activity`). ``None``: unknown."""
    if process.sm_ratio is not None:
        return process.sm_ratio
    if gpu.mig_instances:
        return _instance_activity(process, gpu)
    return whole_gpu_activity(gpu)


def whole_gpu_activity(gpu: Gpu) -> float | None:
    """The busiest of the GPU's kernel, encoder and decoder utilisation when one is
    above 0 (every process on it may have done that work); ``None`` otherwise.

    ``nvmlDeviceGetUtilizationRates`` and the encoder and decoder figures cover NVML's
    last sample period (1/6 s to 1 s), not the time since the previous poll: a 0 there
    cannot show that nothing ran in between, and a figure that could not be read shows
    nothing at all. So this fallback can make a process active, never idle.
    """
    figures = [f for f in (gpu.utilization_ratio, gpu.encoder_ratio, gpu.decoder_ratio) if f]
    return max(figures) if figures else None


def _instance_activity(process: GpuProcess, gpu: Gpu) -> float | None:
    """The activity of the MIG instance ``process`` runs in (``None``: unknown)."""
    if process.gpu_instance_id is None:
        return None
    for instance in gpu.mig_instances:
        if instance.gpu_instance_id == process.gpu_instance_id:
            return instance.activity_ratio
    return None


class ProcessHistory:
    """Bounded per-process activity runs, fed by every poll. Thread-safe.

    ``cpu_seconds(pid)`` returns a process's CPU time so far (``None`` if unknown);
    the history asks only for processes whose GPU side looks idle and that hold at
    least ``cpu_min_bytes`` (an active one is active whatever its CPU does, and one
    below the reaper's memory floor is never a candidate). ``cover_seconds`` is the
    longest gap between two polls still counted as observed (1.5 poll intervals by
    default).
    """

    def __init__(
        self,
        *,
        poll_interval_seconds: float,
        history_seconds: float,
        max_gap_seconds: float,
        max_runs: int,
        cpu_busy_ratio: float = 0.0,
        cpu_seconds: Callable[[int], float | None] | None = None,
        cover_seconds: float | None = None,
        cpu_min_bytes: int = 0,
    ) -> None:
        self.poll_interval_seconds = poll_interval_seconds
        self.history_seconds = history_seconds
        self.max_gap_seconds = max_gap_seconds
        self.cover_seconds = (
            cover_seconds if cover_seconds is not None else 1.5 * poll_interval_seconds
        )
        self._max_runs = max_runs
        self._cpu_busy_ratio = cpu_busy_ratio
        self._cpu_seconds = cpu_seconds if cpu_busy_ratio > 0 else None
        self._cpu_min_bytes = cpu_min_bytes
        self._tracks: dict[TrackKey, _Track] = {}
        self._lock = threading.Lock()

    def observe(self, snapshot: HostSnapshot, *, at: float | None = None) -> None:
        """Add one poll, stamped ``at`` (the agent's steady clock; ``None``: the
        snapshot's ``collected_at``, for replays of recorded snapshots). A poll stamped
        like the previous one is the same poll again and is ignored; one stamped
        earlier breaks the history there (:meth:`_add`)."""
        t = snapshot.collected_at if at is None else at
        polled = list(_observations(snapshot))
        cpu: dict[int, float | None] = {}
        if self._cpu_seconds is not None:
            for _, _, process, activity, _ in polled:
                if (
                    activity == "idle"
                    and process.visible
                    and (process.used_bytes or 0) >= self._cpu_min_bytes
                    and process.pid not in cpu
                ):
                    cpu[process.pid] = self._cpu_seconds(process.pid)
        with self._lock:
            for gpu_index, gpu_uuid, process, activity, ratio in polled:
                key = (gpu_uuid, process.pid, process.start_time)
                track = self._tracks.get(key)
                if track is None:
                    track = _Track(
                        gpu_index, gpu_uuid, process.pid, process.start_time, t, None, []
                    )
                    self._tracks[key] = track
                self._add(track, t, activity, ratio, process, cpu.get(process.pid))
            self._expire(t, {g.uuid for g in snapshot.gpus if not g.lost and g.read_error is None})

    def _add(
        self,
        track: _Track,
        t: float,
        activity: Activity,
        ratio: float | None,
        process: GpuProcess,
        cpu: float | None,
    ) -> None:
        runs = track.runs
        dt = t - track.last_t
        if runs and dt == 0:
            return  # the same poll again
        if runs and dt < 0:
            # A stamp from before the previous poll: the clock went back (only a wall
            # clock does). Joining it would hide this poll or stretch a run across
            # time nobody observed, so nothing before it is kept: a gap, never idle.
            runs.clear()
            track.last_cpu = None
            track.last_used = None
        used = process.used_bytes
        if (
            activity == "idle"
            and used is not None
            and track.last_used is not None
            and used - track.last_used > MEMORY_GROWTH_BYTES
        ):
            activity = "active"  # still allocating: not idle, whatever the engines say
        track.last_used = used
        cpu_busy = False
        if cpu is not None and track.last_cpu is not None and runs and dt > 0:
            cpu_busy = (cpu - track.last_cpu) / dt > self._cpu_busy_ratio
        track.last_cpu = cpu
        covered = bool(runs) and 0 < dt <= self.cover_seconds
        sm = ratio or 0.0
        last = runs[-1] if runs else None
        track.last_t = t
        if last is not None and covered and last.activity == activity and last.cpu_busy == cpu_busy:
            last.end = t
            last.low_bytes = (
                None if used is None or last.low_bytes is None else min(last.low_bytes, used)
            )
            last.high_bytes = (
                None if used is None or last.high_bytes is None else max(last.high_bytes, used)
            )
            last.busiest_ratio = max(last.busiest_ratio, sm)
            return
        # The poll's SM figure is about the time since the previous poll, so a run that
        # starts right after a covered poll covers that interval too.
        start = t - dt if covered else t
        if last is not None and (last.activity != "idle" or t - last.end > self.max_gap_seconds):
            # The idle verdict never looks past a non-idle run or a long gap.
            del runs[:-1]
            if t - last.end > self.max_gap_seconds:
                runs.clear()
        runs.append(Run(start, t, activity, used, used, sm, cpu_busy))
        if len(runs) > self._max_runs:
            del runs[: len(runs) - self._max_runs]

    def _expire(self, now: float, read: set[str]) -> None:
        """Forget processes not seen for ``max_gap`` on a GPU this poll ``read`` (UUIDs);
        on any other GPU not seeing them proves nothing (module docstring)."""
        horizon = now - self.history_seconds
        stale = now - self.max_gap_seconds
        gone = [
            key
            for key, track in self._tracks.items()
            if track.last_t < stale and track.gpu_uuid in read
        ]
        for key in gone:
            del self._tracks[key]
        for track in self._tracks.values():
            if track.runs and track.runs[0].end < horizon:
                track.runs = [r for r in track.runs if r.end >= horizon]

    def runs_for(self, gpu_uuid: str, pid: int, start_time: float | None) -> list[Run] | None:
        """A copy of that process's runs on that GPU (``None``: not tracked); see
        :meth:`HistoryReport.runs_for` for how start times match."""
        if start_time is None:
            return None
        with self._lock:
            track = self._tracks.get((gpu_uuid, pid, start_time))
            if track is None:
                track = next(
                    (
                        t
                        for (uuid, p, s), t in self._tracks.items()
                        if uuid == gpu_uuid and p == pid and same_start(s, start_time)
                    ),
                    None,
                )
            if track is None:
                return None
            return [
                Run(
                    r.start,
                    r.end,
                    r.activity,
                    r.low_bytes,
                    r.high_bytes,
                    r.busiest_ratio,
                    r.cpu_busy,
                )
                for r in track.runs
            ]

    def gpus_for(self, pid: int, start_time: float | None) -> list[tuple[int, str]]:
        """The GPUs ``(index, uuid)`` this history has that process on (start times
        matched as in :meth:`runs_for`; an unknown one matches nothing)."""
        with self._lock:
            return sorted(
                (t.gpu_index, t.gpu_uuid)
                for (_, p, s), t in self._tracks.items()
                if p == pid and same_start(s, start_time)
            )

    def __len__(self) -> int:
        with self._lock:
            return len(self._tracks)

    def tracks(self, pid: int | None = None) -> list[TrackView]:
        """A copy of every track (or only ``pid``'s), for serving."""
        with self._lock:
            return [
                TrackView(
                    t.gpu_index,
                    t.gpu_uuid,
                    t.pid,
                    t.start_time,
                    t.last_t,
                    [_copy(r) for r in t.runs],
                )
                for t in self._tracks.values()
                if pid is None or t.pid == pid
            ]


@dataclass(frozen=True)
class TrackView:
    """One process on one GPU: its identity, when it was last polled, and its runs."""

    gpu_index: int
    gpu_uuid: str
    pid: int
    start_time: float | None
    last_seen: float
    runs: list[Run]


def _copy(r: Run) -> Run:
    return Run(r.start, r.end, r.activity, r.low_bytes, r.high_bytes, r.busiest_ratio, r.cpu_busy)


def _observations(
    snapshot: HostSnapshot,
) -> Iterable[tuple[int, str, GpuProcess, Activity, float | None]]:
    """``(gpu index, gpu uuid, process, activity, ratio)`` once per process and GPU."""
    for gpu in snapshot.gpus:
        if gpu.lost or gpu.read_error is not None:
            continue  # nothing is known about this GPU's processes: a gap for each
        seen: dict[int, tuple[GpuProcess, Activity, float | None]] = {}
        for process in gpu.processes:
            ratio = activity_ratio(process, gpu)
            activity = _verdict(ratio)
            previous = seen.get(process.pid)
            # A PID listed twice (a compute and a graphics context) is one process: any
            # activity wins, then unknown, and it is idle only if both say so.
            if previous is None or _rank(activity) > _rank(previous[1]):
                seen[process.pid] = (process, activity, ratio)
        for process, activity, ratio in seen.values():
            yield gpu.index, gpu.uuid, process, activity, ratio


def _rank(activity: Activity) -> int:
    return {"idle": 0, "unknown": 1, "active": 2}[activity]
