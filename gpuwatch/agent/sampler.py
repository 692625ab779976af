"""One poll of the host -> one :class:`~gpuwatch.snapshot.HostSnapshot`.

The sampler joins three views: what NVML says each GPU holds (``gpuwatch.nvml``), who
each PID is (``gpuwatch.agent.procinfo``), and what PyTorch's allocator said from inside
the process (``gpuwatch.agent.torch_reports``). It owns none of them; they are passed in.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from gpuwatch.agent.identity import HostIdentity
from gpuwatch.agent.procinfo import ProcessFacts, ProcInfo
from gpuwatch.agent.torch_reports import TorchReports
from gpuwatch.nvml.bounded import BoundedReader, DeviceTimeout
from gpuwatch.nvml.gpm import GpmActivity
from gpuwatch.nvml.health import HEALTH_FIELDS
from gpuwatch.nvml.library import (
    DeviceReading,
    NvmlSession,
    ProcessUsage,
    unknown_uuid,
)
from gpuwatch.snapshot import (
    UNKNOWN_GPU_UUID_PREFIX,
    Gpu,
    GpuProcess,
    HostSnapshot,
    MigInstance,
    Profiling,
)
from gpuwatch.wire import NamedDevice

# GPUs whose memory is coherent with the CPU (Grace Hopper / Grace Blackwell): NVML's
# "used" there includes memory no process list accounts for, so "unattributed" is masked.
_COHERENT_MARKERS = ("GH200", "GB200", "GB300", "Grace")
# At most one log line per this many seconds for PIDs that could not be described.
DESCRIBE_FAILURE_LOG_SECONDS = 300.0

log = logging.getLogger(__name__)


__all__ = ["PID_REUSE_TOLERANCE_SECONDS", "HostIdentity", "Sampler"]


class Sampler:
    """Polls NVML and ``/proc`` and returns snapshots with a rising ``sequence``."""

    def __init__(
        self,
        session: NvmlSession,
        procinfo: ProcInfo,
        identity: HostIdentity,
        *,
        timeout_seconds: float,
        torch_reports: TorchReports | None = None,
        pid_namespace_isolated: bool = False,
        fake: bool = False,
        clock: Callable[[], float] = time.time,
        first_sequence: int | None = None,
        confirm_gone: bool = True,
    ) -> None:
        """``confirm_gone``: report a PID gone from ``/proc`` as dead only at the second
        poll in a row (see :meth:`_owner`); a one-shot read (``gpuwatch status``) has
        no second poll and reports what it sees."""
        self._session = session
        self._reader = BoundedReader(session, timeout=timeout_seconds)
        self._procinfo = procinfo
        self._identity = identity
        self._torch = torch_reports
        self._isolated = pid_namespace_isolated
        self._fake = fake
        self._clock = clock
        # The sequence starts at the start time in milliseconds, so an agent restarted
        # within the same boot usually continues above every sequence it sent before
        # (polls are seconds apart). A clock behind at the restart starts it lower, and
        # the server answers those snapshots `late` until the clock catches up.
        self._sequence = int(clock() * 1000) if first_sequence is None else first_sequence
        # (GPU index, PID) -> seconds since boot when NVML first listed it, while it stays
        # listed poll after poll; and those found gone in /proc at the previous poll.
        self._listed_since: dict[tuple[int, int], float | None] = {}
        self._gone_before: set[tuple[int, int]] = set()
        self._gone_now: set[tuple[int, int]] = set()
        self._listed_now: set[tuple[int, int]] = set()
        # (GPU index, PID) -> what /proc said of its owner at the last poll it was alive,
        # while it stays listed: a process that dies and leaves its context is still
        # named (see _owner).
        self._last_alive: dict[tuple[int, int], ProcessFacts] = {}
        self._uptime: float | None = None
        self._confirm_gone = confirm_gone
        self._host_devices: tuple[NamedDevice, ...] = ()
        # GPU index -> (uuid, name, PCI bus id) as last read: a GPU that falls off the
        # bus, or whose read hangs, answers nothing, but it is still the board it was.
        self._known: dict[int, tuple[str, str | None, str | None]] = {}
        # Describe failures since the last line about them, and when that line was written.
        self._describe_failures = 0
        self._describe_logged_at: float | None = None

    def poll(self) -> HostSnapshot:
        started = time.perf_counter()
        collected_at = self._clock()
        count = self._session.device_count()
        self._uptime = self._procinfo.uptime()
        readings = self._reader.read_all(count)
        # Every GPU and MIG instance: a UUID a torch report gives is resolved among them all.
        self._host_devices = _host_devices(readings)
        gpus = [self._gpu(reading) for reading in readings]
        # A GPU this poll could not read listed nothing, which says nothing of its
        # processes: what was known of them carries over. Forgetting when a context was
        # first listed let the next poll take a process that had since been given a
        # dead owner's PID for the context's owner (blamed, then idle for an hour).
        unread = {
            r.index
            for r in readings
            if isinstance(r, DeviceTimeout) or r.lost or r.read_error is not None
        }
        self._gone_before = self._gone_now | {k for k in self._gone_before if k[0] in unread}
        self._gone_now = set()
        self._listed_since = {
            k: v for k, v in self._listed_since.items() if k in self._listed_now or k[0] in unread
        }
        self._last_alive = {k: v for k, v in self._last_alive.items() if k in self._listed_since}
        self._listed_now = set()
        self._sequence += 1
        return HostSnapshot(
            agent_id=self._identity.agent_id,
            hostname=self._identity.hostname,
            boot_id=self._identity.boot_id,
            sequence=self._sequence,
            collected_at=collected_at,
            poll_duration_seconds=time.perf_counter() - started,
            driver_version=self._session.driver_version,
            nvml_version=self._session.nvml_version,
            cuda_driver_version=self._session.cuda_driver_version,
            pid_namespace_isolated=self._isolated,
            fake=self._fake,
            gpus=gpus,
        )

    @property
    def reader_notes(self) -> list[str]:
        """What limits this agent's view of other processes (ProcInfo.reader_notes)."""
        return self._procinfo.reader_notes

    def _last_identity(self, index: int, reading: DeviceReading | None = None) -> dict[str, Any]:
        """What identifies GPU ``index`` when this poll could not read it: what the
        reading still has (a lost GPU may answer its UUID), else what it was last read
        as, else a placeholder UUID. Without it a lost board was reported as
        ``GPU-unknown-N`` with no name or bus id: the alert could not say which board to
        pull, and the server listed it as a new GPU beside the real one."""
        uuid, name, bus = self._known.get(index, (unknown_uuid(index), None, None))
        if reading is not None and not reading.uuid.startswith(UNKNOWN_GPU_UUID_PREFIX):
            if reading.uuid != uuid:  # another board at this index now: nothing carries
                name = bus = None
            uuid, name = reading.uuid, reading.name or name
        return {"index": index, "uuid": uuid, "name": name, "pci_bus_id": bus}

    def _gpu(self, reading: DeviceReading | DeviceTimeout) -> Gpu:
        if isinstance(reading, DeviceTimeout):
            return Gpu(**self._last_identity(reading.index), read_error="timeout")
        if reading.lost:
            return Gpu(**self._last_identity(reading.index, reading), lost=True)
        if reading.read_error is not None:
            # No handle (NO_PERMISSION, UNKNOWN after the board fell off the bus, ...):
            # nothing was read, so nothing is known of its processes either.
            return Gpu(
                **self._last_identity(reading.index, reading),
                read_error=reading.read_error,
                processes_visible=False,
            )
        if not reading.uuid.startswith(UNKNOWN_GPU_UUID_PREFIX):
            self._known[reading.index] = (reading.uuid, reading.name, reading.pci_bus_id)
        processes = [self._process(reading, usage) for usage in _one_per_pid(reading.processes)]
        coherent = reading.coherent_memory
        if coherent is None:  # older drivers: go by the model name
            coherent = any(marker in (reading.name or "") for marker in _COHERENT_MARKERS)
        # Not visible: another PID namespace, or NVML would not list them this poll
        # (then what it listed is not all there is, and no process ended).
        visible = (not self._isolated or any(p.visible for p in processes)) and not (
            reading.processes_unlisted
        )
        return Gpu(
            index=reading.index,
            uuid=reading.uuid,
            name=reading.name,
            pci_bus_id=reading.pci_bus_id,
            memory_total_bytes=reading.memory_total_bytes,
            memory_used_bytes=reading.memory_used_bytes,
            memory_free_bytes=reading.memory_free_bytes,
            memory_reserved_bytes=reading.memory_reserved_bytes,
            utilization_ratio=reading.utilization_ratio,
            memory_busy_ratio=reading.memory_busy_ratio,
            temperature_celsius=reading.temperature_celsius,
            power_watts=reading.power_watts,
            power_limit_watts=reading.power_limit_watts,
            **{name: getattr(reading, name) for name in HEALTH_FIELDS},
            profiling=_profiling(reading.gpm),
            coherent_memory=coherent,
            processes_visible=visible,
            unattributed_bytes=_unattributed(reading, masked=coherent or not visible),
            processes=processes,
            mig_instances=[
                MigInstance(
                    index=m.index,
                    uuid=m.uuid,
                    name=m.name,
                    memory_total_bytes=m.memory_total_bytes,
                    memory_used_bytes=m.memory_used_bytes,
                    gpu_instance_id=m.gpu_instance_id,
                    profile=m.profile,
                    activity_ratio=m.activity_ratio,
                    profiling=_profiling(m.gpm),
                )
                for m in reading.mig
            ],
        )

    def _process(self, reading: DeviceReading, usage: ProcessUsage) -> GpuProcess:
        facts = self._owner(reading.index, self._describe(usage.pid))
        sm: float | None = None
        if reading.process_sm is not None:
            sm = reading.process_sm.get(usage.pid, 0.0)
        torch = None
        if self._torch is not None and facts.alive:
            # By UUID where the report names one: PyTorch's device ordinal, which an
            # older reporter sends as the index, is not NVML's index.
            torch = self._torch.get(
                usage.pid,
                reading.index,
                start_time=facts.start_time,
                uuids=_uuids(reading),
                host=self._host_devices,
            )
        return GpuProcess(
            pid=usage.pid,
            kind=usage.kind,
            used_bytes=usage.used_bytes,
            sm_ratio=sm,
            # Only meaningful against the GPU's instances; off MIG NVML may say 0.
            gpu_instance_id=usage.gpu_instance_id if reading.mig else None,
            torch=torch,
            **facts.to_gpu_process_fields(),
        )

    def _describe(self, pid: int) -> ProcessFacts:
        """``ProcInfo.describe``, which must never cost the poll: other users choose their
        processes' names, cgroups and users, and one oddity nobody foresaw would otherwise
        stop the agent (metrics, pushes and the reaper with it). Such a PID is reported
        owner unknown (not visible; :meth:`_owner` keeps what was last seen of it), with a
        log line at most every :data:`DESCRIBE_FAILURE_LOG_SECONDS`."""
        try:
            return self._procinfo.describe(pid)
        except Exception as err:  # the poll goes on: see the docstring
            self._describe_failures += 1
            now = self._clock()
            last = self._describe_logged_at
            # abs(): a wall clock stepped back must not silence the line for that long.
            if last is None or abs(now - last) >= DESCRIBE_FAILURE_LOG_SECONDS:
                first_line = (str(err).splitlines() or [""])[0]
                log.warning(
                    "cannot describe PID %d (shown as owner unknown; %d such failure(s) since"
                    " the last line): %s: %s",
                    pid,
                    self._describe_failures,
                    type(err).__name__,
                    first_line,
                )
                self._describe_failures = 0
                self._describe_logged_at = now
            return ProcessFacts(pid=pid, alive=True, visible=False)

    def _owner(self, index: int, facts: ProcessFacts) -> ProcessFacts:
        """What ``/proc`` says of the PID NVML listed, checked against NVML's past lists.

        * A process that started after NVML first listed its PID on this GPU (seconds
          since boot, so clock steps do not matter) cannot own that context: the owner
          died and the kernel gave its PID to another process, which is then not blamed
          (nor idle, nor reaped); the context is reported as a dead PID's.
        * A PID gone from ``/proc`` is reported dead only at the second poll in a row:
          a process that exits between NVML's list and the ``/proc`` read, or whose
          context the driver is still tearing down, would otherwise open a dead-PID
          event for every normal exit. At the first, it is reported as not visible
          (unknown), which no detector judges.
        * A PID that is dead, gone or hidden keeps the owner ``/proc`` gave at the last
          poll it was alive while NVML listed it on this GPU (start time, user, command,
          container, job): the context is that process's, and whoever ran it is the one
          to ask. Only who it was carries over, not what it was doing (orphaned, its
          notebook server). A reused PID's new process is never that owner.
        """
        key = (index, facts.pid)
        self._listed_now.add(key)
        listed = self._listed_since.setdefault(key, self._uptime)
        started = self._procinfo.seconds_since_boot(facts.start_time)
        reused = (
            listed is not None
            and started is not None
            and started > listed + PID_REUSE_TOLERANCE_SECONDS
        )
        if facts.alive and reused:
            facts = ProcessFacts(pid=facts.pid, alive=False)
        if facts.alive and facts.visible:
            self._last_alive[key] = facts
            return facts
        if facts.alive or not facts.visible:
            return self._as_last_seen(key, facts)
        self._gone_now.add(key)
        if key in self._gone_before or not self._confirm_gone:
            return self._as_last_seen(key, facts)
        return self._as_last_seen(key, ProcessFacts(pid=facts.pid, alive=True, visible=False))

    def _as_last_seen(self, key: tuple[int, int], facts: ProcessFacts) -> ProcessFacts:
        """``facts`` (a PID not seen alive now) with the owner last seen alive under ``key``."""
        known = self._last_alive.get(key)
        if known is None:
            return facts
        return replace(
            known,
            alive=facts.alive,
            visible=facts.visible,
            orphaned=False,
            jupyter_server_alive=None,
        )


# /proc's start time and boot time are whole clock ticks and whole seconds: a process
# that started before NVML listed its context may still seem to start up to this later.
PID_REUSE_TOLERANCE_SECONDS = 2.0


def _host_devices(readings: list[DeviceReading | DeviceTimeout]) -> tuple[NamedDevice, ...]:
    """Each GPU read and each of its MIG instances, named as NVML names them."""
    devices: list[NamedDevice] = []
    for reading in readings:
        if isinstance(reading, DeviceTimeout):
            continue
        devices.append(NamedDevice(reading.uuid))
        devices.extend(NamedDevice(m.uuid, reading.uuid, m.gpu_instance_id) for m in reading.mig)
    return tuple(devices)


def _uuids(reading: DeviceReading) -> tuple[str, ...]:
    """The GPU's UUID and its MIG instances' (a process in a MIG instance sees that
    instance's UUID as its device's)."""
    return (reading.uuid, *(m.uuid for m in reading.mig))


def _profiling(activity: GpmActivity | None) -> Profiling | None:
    return None if activity is None else Profiling(**vars(activity))


def _unattributed(reading: DeviceReading, *, masked: bool) -> int | None:
    """Memory NVML counts as used that no listed process accounts for (bytes).

    ``None`` when it cannot be known: masked (coherent memory, processes not visible),
    MIG (the parent's "used" spans instances), a process whose usage NVML withholds,
    "used" from memory info v1 (it includes the driver's reserved memory, which no
    figure separates), or a read that was not consistent.

    Consistent: NVML has no call that returns a GPU's memory and its process list
    together, so the library reads the process list, then the memory, then the process
    list again. When the two lists differ (a process came or went, or the memory the
    listed processes hold changed), the memory figure may belong to either list: a
    large free between the reads would show up as gigabytes no process holds, and the
    server would open a false "unattributed" event on it. Such a poll reports ``None``
    (unknown) rather than a figure made up from one of the lists. It is not re-read:
    the next poll comes within seconds, a process that allocates steadily would likely
    change again during a re-read, and a second read would lengthen every poll that
    races a change and add another chance to meet a hung NVML call.
    """
    if masked or reading.mig or reading.memory_used_bytes is None:
        return None
    if reading.memory_used_includes_reserved:
        return None
    held = _held_bytes(reading.processes)
    if held is None or reading.processes_before_memory is None:
        return None
    if _held_bytes(reading.processes_before_memory) != held:
        return None
    return max(0, reading.memory_used_bytes - sum(held.values()))


# The kind reported for a PID NVML lists under several: nvidia-smi's "C+G" is compute.
_KIND_PRECEDENCE = ("compute", "mps", "graphics")


def _one_per_pid(processes: list[ProcessUsage]) -> list[ProcessUsage]:
    """One row per PID, in NVML's order. A process with both a compute and a graphics
    context (nvidia-smi's "C+G": CUDA with OpenGL, Isaac Sim, a desktop app) is listed once
    per kind with the same memory; two rows would be two metric series with one label set
    (Prometheus drops one), two lines in ``status`` and its memory counted twice. It is one
    process: the first kind in :data:`_KIND_PRECEDENCE`, the larger known memory figure."""
    merged: dict[int, ProcessUsage] = {}
    for usage in processes:
        first = merged.get(usage.pid)
        if first is None:
            merged[usage.pid] = usage
            continue
        merged[usage.pid] = replace(
            first,
            kind=min(first.kind, usage.kind, key=_KIND_PRECEDENCE.index),
            used_bytes=_larger(first.used_bytes, usage.used_bytes),
            gpu_instance_id=(
                first.gpu_instance_id
                if first.gpu_instance_id is not None
                else usage.gpu_instance_id
            ),
        )
    return list(merged.values())


def _larger(a: int | None, b: int | None) -> int | None:
    """The larger figure; an unknown one (None) neither wins nor loses."""
    return b if a is None else a if b is None else max(a, b)


def _held_bytes(processes: list[ProcessUsage]) -> dict[int, int] | None:
    """Bytes held per PID; ``None`` when NVML withholds any process's usage."""
    # A process with both a compute and a graphics context is listed twice with the same
    # memory; count each PID once.
    per_pid: dict[int, int] = {}
    for p in processes:
        if p.used_bytes is None:
            return None
        per_pid[p.pid] = max(per_pid.get(p.pid, 0), p.used_bytes)
    return per_pid
