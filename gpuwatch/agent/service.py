"""The running agent: poll on an interval, export, and push to the server when configured.

Data flows one way: NVML -> :class:`~gpuwatch.agent.sampler.Sampler` -> snapshot ->
{:class:`~gpuwatch.agent.state.AgentState` (read by ``/metrics`` and ``/snapshot``),
reporter -> central server}. A failed poll is counted and logged once per failure
streak; the loop keeps going, because a GPU that errors now may answer in a minute.

Polls and pushes keep fixed deadlines on a monotonic clock
(:mod:`gpuwatch.agent.cadence`): pushed snapshots are ``push_interval_seconds`` apart
however long each poll takes.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from gpuwatch.agent.cadence import PollSchedule, PushSchedule
from gpuwatch.agent.collectors.agent import AgentCollector, PushStats
from gpuwatch.agent.collectors.dcgm import DcgmCompatCollector
from gpuwatch.agent.collectors.gpu import GpuCollector
from gpuwatch.agent.collectors.process import ProcessCollector
from gpuwatch.agent.collectors.reaper import ReaperCollector
from gpuwatch.agent.collectors.registry import NamedCollector, ScrapeRenderer
from gpuwatch.agent.exporter import Exporter
from gpuwatch.agent.incident_origin import IncidentOrigin
from gpuwatch.agent.port import PortPolicy
from gpuwatch.agent.reaper.hooks import ReaperHooks
from gpuwatch.agent.reaper.procfs import ProcReader
from gpuwatch.agent.state import AgentState
from gpuwatch.agent.torch_reports import TorchReports
from gpuwatch.errors import GpuwatchError
from gpuwatch.settings import AgentSettings, parse_host_port
from gpuwatch.snapshot import HostSnapshot, MigInstance
from gpuwatch.wire import (
    MAX_EVENT_SUMMARY_CHARS,
    NamedDevice,
    OomIncident,
    ReportedEvent,
    find_device,
)

log = logging.getLogger(__name__)


class Poller(Protocol):
    """One poll of the host (:class:`~gpuwatch.agent.sampler.Sampler` in production)."""

    def poll(self) -> HostSnapshot:
        """Raises :class:`~gpuwatch.errors.GpuwatchError` when the host cannot be read."""
        ...


class SnapshotSink(Protocol):
    """Where snapshots go besides the exporter (the reporter to the central server)."""

    def offer(self, snapshot: HostSnapshot) -> None: ...

    def push_stats(self) -> PushStats: ...

    def send_event(self, event: ReportedEvent) -> object: ...

    def spool_problem(self) -> str | None:
        """Why the spool refuses writes (``None`` while it takes them)."""
        ...

    def start(self) -> None: ...

    def stop(self) -> None: ...


class BusiestSincePush:
    """The busiest activity (``sm_ratio``) each process showed at any poll since the last
    pushed snapshot, carried into the next pushed one.

    The agent polls more often than it pushes (5 s and 15 s by default), and each poll
    reads the activity since the poll before: without this, a request served during a
    poll that is not pushed would never reach the server, and a process answering one
    short request every few minutes could be called idle, which needs every poll of an
    hour observed at zero. Memory is not carried: the polls pushed still bound it.
    """

    def __init__(self) -> None:
        self._seen: dict[tuple[int, int, float | None], float] = {}

    def note(self, snapshot: HostSnapshot) -> None:
        for gpu in snapshot.gpus:
            for p in gpu.processes:
                if p.sm_ratio is not None:
                    key = (gpu.index, p.pid, p.start_time)
                    self._seen[key] = max(self._seen.get(key, 0.0), p.sm_ratio)

    def carried_into(self, snapshot: HostSnapshot) -> HostSnapshot:
        """``snapshot`` with each process's busiest activity since the last push (its
        own reading when none was busier; an unknown one stays unknown unless some
        poll saw activity); starts the next period."""
        seen, self._seen = self._seen, {}
        gpus = []
        for gpu in snapshot.gpus:
            processes = []
            for p in gpu.processes:
                busiest = seen.get((gpu.index, p.pid, p.start_time))
                if busiest is not None and busiest > (p.sm_ratio or 0.0):
                    p = p.model_copy(update={"sm_ratio": busiest})
                processes.append(p)
            gpus.append(gpu.model_copy(update={"processes": processes}))
        return snapshot.model_copy(update={"gpus": gpus})


class Agent:
    """Owns the poll loop and the exporter; everything it needs is passed in.

    ``clock`` is Unix epoch seconds (for incidents without a time of their own);
    ``monotonic`` is the clock polls and pushes are scheduled on; ``wait(seconds)``
    sleeps up to ``seconds`` and returns True when the agent is to stop (default: the
    wait on :meth:`stop`'s event). A test passes a fake ``monotonic`` and ``wait`` and
    runs hours of polling without sleeping.
    """

    def __init__(
        self,
        settings: AgentSettings,
        *,
        sampler: Poller,
        state: AgentState,
        torch_reports: TorchReports,
        sink: SnapshotSink | None = None,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
        wait: Callable[[float], bool] | None = None,
        reaper: ReaperHooks | None = None,
    ) -> None:
        self._settings = settings
        self._sampler = sampler
        self.state = state
        self._torch = torch_reports
        self._sink = sink
        self._clock = clock
        self._monotonic = monotonic
        self._stop = threading.Event()
        self._wait = wait if wait is not None else self._stop.wait
        self._pushes = PushSchedule(
            settings.push_interval_seconds,
            tolerance_seconds=settings.poll_interval_seconds / 2,
        )
        self._failing = False
        # Reads /proc for the OOM incidents the reaper policy may count (made on first use).
        self._procs: ProcReader | None = None
        # The busiest activity each process showed since the last pushed snapshot.
        self._busiest = BusiestSincePush()
        # The reaper's history (and its policy, when on) sees every poll.
        self.reaper = reaper or ReaperHooks.build(
            settings, report=sink.send_event if sink else None, clock=clock
        )
        self.exporter = Exporter(
            parse_host_port(settings.listen),
            render_metrics=self._renderer().render,
            state=state,
            torch_reports=torch_reports,
            poll_interval_seconds=settings.poll_interval_seconds,
            on_oom_from=self._on_oom,
            history=self.reaper.history_json,
            clock=clock,
            policy=PortPolicy.from_settings(settings),
            spool_problem=sink.spool_problem if sink else None,
        )

    def _renderer(self) -> ScrapeRenderer:
        source = lambda: self.state.current  # noqa: E731 - read at scrape time
        from_snapshot: list[NamedCollector] = [
            GpuCollector(source),
            ProcessCollector(
                source,
                enabled=self._settings.process_metrics,
                max_series=self._settings.process_metrics_max_series,
            ),
        ]
        if self._settings.dcgm_compat:
            from_snapshot.append(DcgmCompatCollector(source))
        live: list[NamedCollector] = [
            AgentCollector(
                self.state,
                torch_reports_total=lambda: self._torch.received_total,
                push_stats=self._sink.push_stats if self._sink else None,
                # Read at scrape time: the exporter is built after its renderer.
                oom_posts_refused_total=lambda: self.exporter.oom_posts.refused_total,
            ),
            ReaperCollector(self.reaper.policy_counts),
        ]
        return ScrapeRenderer(from_snapshot, live, sequence=self._latest_sequence)

    def _latest_sequence(self) -> int | None:
        # What the snapshot families were rendered from: the current poll, or none.
        current = self.state.current
        return None if current is None else current.sequence

    def poll_once(self) -> HostSnapshot | None:
        """Poll now, outside the schedule; the snapshot is recorded, and offered to the
        sink when a push is due. ``None`` on failure."""
        return self._poll(scheduled=self._monotonic())

    def _poll(self, *, scheduled: float) -> HostSnapshot | None:
        """The poll scheduled at ``scheduled`` (monotonic seconds); see :meth:`poll_once`."""
        try:
            snapshot = self._sampler.poll()
        except GpuwatchError as err:
            self.state.record_failure()
            if not self._failing:
                log.error("poll failed: %s", err)
                self._failing = True
            return None
        if self._failing:
            log.warning("polls succeed again")
            self._failing = False
        self.state.record_poll(snapshot)
        self.reaper.after_poll(snapshot)
        self._busiest.note(snapshot)
        # Judged by when the poll was due, not when it ended: a poll's duration must
        # not decide whether its snapshot is pushed.
        if self._sink is not None and self._pushes.due(scheduled):
            self._sink.offer(self._busiest.carried_into(snapshot))
            self._pushes.offered(scheduled)
        return snapshot

    def run(self) -> None:
        """Serve and poll until :meth:`stop` is called (SIGTERM / SIGINT in the CLI)."""
        self.exporter.start()
        if self._sink is not None:
            self._sink.start()
        log.info("agent serving on %s", self.exporter.url)
        try:
            self._poll_loop()
        finally:
            if self._sink is not None:
                self._sink.stop()
            self.exporter.stop()

    def _poll_loop(self) -> None:
        polls = PollSchedule(self._settings.poll_interval_seconds, start=self._monotonic())
        while not self._stop.is_set():
            wait = polls.next_at - self._monotonic()
            if wait > 0:
                if self._wait(wait):
                    return
                continue  # re-read the clock: a wait may end early
            self._poll(scheduled=polls.claim(self._monotonic()))

    def stop(self) -> None:
        self._stop.set()

    def _on_oom(self, incident: OomIncident, origin: IncidentOrigin) -> None:
        """An OOM incident from ``gpuwatch.torch``: attach who was on the GPU, forward it,
        and hand it to the reaper policy when it shows contention (:func:`not_contention`)."""
        received_at = self._clock()
        latest = self.state.latest
        gpu_index, instance = incident_device(incident, latest)
        log.warning("OOM incident reported by pid %s on GPU %s", incident.pid, gpu_index)
        self._note_contention(incident, origin, latest, gpu_index, instance, received_at)
        if self._sink is None:
            return
        # The incident keeps the time its sender reported (information); only the
        # policy must not trust it.
        occurred_at = received_at if incident.occurred_at is None else incident.occurred_at
        reported_uuid = (
            {} if incident.device_uuid is None else {"device_uuid": incident.device_uuid}
        )
        event = ReportedEvent(
            kind="oom",
            hostname=latest.hostname if latest else socket.gethostname(),
            gpu_index=gpu_index,
            pid=incident.pid,
            summary=incident.message[:MAX_EVENT_SUMMARY_CHARS],
            evidence={
                **origin.evidence(),
                **reported_uuid,
                "explanation": incident.explanation,
                # Only the GPU of the incident: who else was on it is the point, and a
                # whole large host would exceed the server's evidence quota.
                "gpu": _gpu_json(latest, gpu_index),
            },
            occurred_at=occurred_at,
        )
        self._sink.send_event(event)

    def _note_contention(
        self,
        incident: OomIncident,
        origin: IncidentOrigin,
        snapshot: HostSnapshot | None,
        gpu_index: int | None,
        instance: MigInstance | None,
        received_at: float,
    ) -> None:
        """Tell the policy (when on) that someone waits for memory on ``gpu_index`` (in
        its MIG ``instance``, when the incident names one), if the incident proves it.
        Any local user can post one, and a counted OOM makes other users' idle
        processes there eligible to be stopped."""
        auto = self.reaper.auto
        if auto is None:
            return
        if self._procs is None:
            self._procs = ProcReader(self._settings.proc_root)
        why = not_contention(
            incident.pid, gpu_index, origin, snapshot, self._procs, instance=instance
        )
        if why is not None:
            log.info(
                "OOM incident from pid %s not counted as contention by the reaper policy: %s",
                incident.pid,
                why,
            )
            return
        # The agent's own receive time: a sender's clock could keep a GPU contended.
        # The place is the MIG instance where there is one: its memory is its own.
        auto.note_oom(
            gpu_index,
            incident.pid,
            received_at,
            gpu_instance_id=None if instance is None else instance.gpu_instance_id,
        )


def incident_gpu(incident: OomIncident, snapshot: HostSnapshot | None) -> int | None:
    """NVML's index of the incident's GPU, ``None`` when unknown (:func:`incident_device`)."""
    return incident_device(incident, snapshot)[0]


def incident_device(
    incident: OomIncident, snapshot: HostSnapshot | None
) -> tuple[int | None, MigInstance | None]:
    """NVML's index of the incident's GPU (``None`` when unknown), and the MIG instance
    its UUID names (``None``: the whole GPU, or no UUID).

    By UUID when the sender named one (its ``device_index`` is PyTorch's ordinal, or a
    guess at NVML's index), resolved among every GPU's UUID and its MIG instances'
    (:func:`~gpuwatch.wire.find_device`: without ``GPU-``/``MIG-``, CUDA 11's
    ``MIG-GPU-<uuid>/<gi>/<ci>``, or a unique prefix); a UUID no device has, or a
    prefix two share, is no GPU. Without a UUID (an older ``gpuwatch.torch``), the index.
    """
    if incident.device_uuid is None:
        return incident.device_index, None
    if snapshot is None:
        return None, None
    devices: list[NamedDevice] = []
    places: dict[NamedDevice, tuple[int, MigInstance | None]] = {}
    for gpu in snapshot.gpus:
        whole = NamedDevice(gpu.uuid)
        devices.append(whole)
        places[whole] = (gpu.index, None)
        for m in gpu.mig_instances:
            named = NamedDevice(m.uuid, gpu.uuid, m.gpu_instance_id)
            devices.append(named)
            places[named] = (gpu.index, m)
    found = find_device(incident.device_uuid, devices)
    return (None, None) if found is None else places[found]


def not_contention(
    pid: int,
    gpu_index: int | None,
    origin: IncidentOrigin,
    snapshot: HostSnapshot | None,
    procs: ProcReader,
    *,
    instance: MigInstance | None = None,
) -> str | None:
    """Why an OOM of ``pid`` on ``gpu_index`` (in its MIG ``instance``, where the report
    names one) does not count as contention for the reaper policy; ``None`` when it
    does.

    It counts only when the GPU exists, ``pid`` holds a context on it in the latest
    poll (a process that ran out of GPU memory has one), is still that same process
    now, and the poster is its owner or root (the socket's uid, not the body's word).
    On a GPU in MIG mode the report must name the MIG instance (by its UUID) and
    ``pid`` must run in it: MIG memory is partitioned, and an OOM on the whole GPU
    cannot say which instance ran short.
    """
    if gpu_index is None:
        return "it names no GPU this agent sees"
    gpu = None if snapshot is None else snapshot.gpu(gpu_index)
    if gpu is None:
        return f"gpu{gpu_index} is not in the agent's latest poll"
    where = f"gpu{gpu_index}"
    if gpu.mig_instances:
        if instance is None:
            return (
                f"gpu{gpu_index} is in MIG mode and the report names none of its MIG "
                "instances: which one ran out of memory is unknown"
            )
        if instance.gpu_instance_id is None:
            return f"the GPU instance id of {instance.uuid} on gpu{gpu_index} is unknown"
        where = f"MIG instance {instance.gpu_instance_id} of gpu{gpu_index}"
    listed = next(
        (
            p
            for p in gpu.processes
            if p.pid == pid
            and p.alive
            and p.visible
            and (instance is None or p.gpu_instance_id == instance.gpu_instance_id)
        ),
        None,
    )
    if listed is None:
        return f"pid {pid} holds no context on {where}"
    now = procs.read(pid)
    if now is None or now.exited:
        return f"pid {pid} is not running"
    if not now.matches(start_time=listed.start_time, uid=listed.owner.uid):
        return f"pid {pid} is not the process NVML listed on {where}"
    if not origin.speaks_for(now.uid):
        return f"the poster (uid {origin.peer_uid}) is neither root nor pid {pid}'s owner (uid {now.uid})"
    return None


def _gpu_json(snapshot: HostSnapshot | None, index: int | None) -> dict[str, Any] | None:
    """The snapshot's GPU ``index`` as JSON (None when unknown)."""
    if snapshot is None or index is None:
        return None
    gpu = snapshot.gpu(index)
    return None if gpu is None else gpu.model_dump(mode="json")
