"""From a live snapshot and the history to decisions: who would be reaped, and why.

The plan is the same for a dry run and a real one: both call :func:`make_plan` on the
same snapshot and history, and only the executor differs. One sample is never enough:
without history every process is ``no_history`` (spared), whatever it shows now.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from gpuwatch.agent.reaper.central import (
    SHORT_REASONS,
    ServerLookup,
    combine,
    server_may_help,
)
from gpuwatch.agent.reaper.errors import ReapRefused
from gpuwatch.agent.reaper.evidence import IdleEvidence, format_duration, idle_evidence
from gpuwatch.agent.reaper.history import MEMORY_GROWTH_BYTES, Run, activity_ratio
from gpuwatch.agent.reaper.policy import (
    Candidate,
    Decision,
    Holding,
    Protections,
    Selection,
    decide,
)
from gpuwatch.snapshot import Gpu, GpuProcess, HostSnapshot

# (gpu uuid, pid, start time) -> runs, or None when there is no history of it.
RunsLookup = Callable[[str, int, float | None], list[Run] | None]
# pid -> the distributed job it is a rank of ("torchrun <run id>", …), or None.
JobLookup = Callable[[int], "str | None"]
# (pid, start time) -> the GPUs (index, uuid) the history has that process on.
HeldLookup = Callable[[int, float | None], list[tuple[int, str]]]

ISOLATED = (
    "this gpuwatch runs in a PID namespace that cannot see the host's processes (a "
    "container without --pid=host / hostPID): NVML reports host PIDs, so a PID here may "
    "name a different process, or none. Refusing; run `gpuwatch reap` on the host."
)

# A history is current when its newest observation is at most this many of the agent's
# poll intervals old; older, the agent has stopped observing and its idle runs prove
# nothing about now.
CURRENT_POLLS = 2.0


@dataclass(frozen=True)
class IdleRule:
    """The idle verdict's parameters: window, memory floor, longest bridged gap, and
    the share of the window the samples must cover (seconds, bytes, 0..1), and how old
    the newest observation may be for the history to count as current (``None``: up to
    ``max_gap_seconds``)."""

    window_seconds: float
    min_memory_bytes: int
    max_gap_seconds: float
    min_coverage: float
    max_age_seconds: float | None = None


@dataclass(frozen=True)
class Plan:
    """Every decision over one snapshot. ``decisions`` lists processes holding at least
    the memory floor on some GPU (or the ``--pid`` target); ``notes`` are for the user."""

    now: float
    hostname: str
    boot_id: str
    window_seconds: float
    decisions: list[Decision]
    notes: list[str] = field(default_factory=list)

    @property
    def chosen(self) -> list[Decision]:
        return [d for d in self.decisions if d.verdict == "reap"]


def make_plan(
    snapshot: HostSnapshot,
    runs_for: RunsLookup | None,
    *,
    now: float,
    rule: IdleRule,
    selection: Selection,
    protections: Protections,
    caller_uid: int | None,
    notes: list[str] | None = None,
    server: ServerLookup | None = None,
    held_on: HeldLookup | None = None,
    job_of: JobLookup | None = None,
) -> Plan:
    """Decide for every GPU process of ``snapshot``. Raises :class:`ReapRefused` when
    the host's PIDs are not visible here, or the ``--pid`` target holds no GPU memory.

    ``server`` (the central server's history) is asked about the processes spared
    only because ``runs_for`` starts inside the window; see the module docstring.
    ``held_on`` (the same history's GPUs per process) finds the GPUs a process held
    memory on that this snapshot cannot read or does not list, whatever UUID the
    snapshot gives them (:func:`candidates_from`)."""
    if snapshot.pid_namespace_isolated:
        raise ReapRefused(ISOLATED)
    candidates = candidates_from(snapshot, runs_for, now=now, rule=rule, held_on=held_on)
    if selection.pid is not None:
        candidates = [c for c in candidates if c.pid == selection.pid]
        if not candidates:
            raise ReapRefused(
                f"PID {selection.pid} holds no GPU memory that NVML lists on this host; nothing to reap"
            )
    else:
        candidates = [c for c in candidates if (c.largest.used_bytes or 0) >= rule.min_memory_bytes]
    decisions = decide(
        candidates, selection=selection, protections=protections, caller_uid=caller_uid
    )
    if server is not None and runs_for is not None and not selection.force:
        decisions = [
            _second_look(
                d,
                runs_for,
                server,
                now=now,
                rule=rule,
                selection=selection,
                protections=protections,
                caller_uid=caller_uid,
            )
            for d in decisions
        ]
    if not selection.force:
        decisions = _spare_for_relatives(
            decisions, snapshot, runs_for, now=now, rule=rule, job_of=job_of
        )
    all_notes = list(notes or [])
    if caller_uid is not None:
        all_notes.append(
            f"not root: only your own processes (uid {caller_uid}) can be reaped; "
            "others are listed and spared"
        )
    return Plan(now, snapshot.hostname, snapshot.boot_id, rule.window_seconds, decisions, all_notes)


def _spare_for_relatives(
    decisions: list[Decision],
    snapshot: HostSnapshot,
    runs_for: RunsLookup | None,
    *,
    now: float,
    rule: IdleRule,
    job_of: JobLookup | None = None,
) -> list[Decision]:
    """Spare a process whose parent or child (among the GPU processes of
    ``snapshot``, by ``ppid``) did GPU work in the window: a job's work may run in a
    child on memory the parent holds and shares (CUDA IPC, ``torch.multiprocessing``:
    the producer must stay alive), so stopping the parent breaks the child's work.

    Likewise a *sibling*: the ranks of one job (torchrun's workers, ``srun`` tasks) are
    children of a launcher without a GPU context; stopping one idle rank leaves the
    others blocked in their next collective until NCCL's timeout, holding their
    memory. So GPU processes of one user with the same parent and the same job
    (``job_of``: what their environment says) count as one: any of them working
    spares all."""
    if not any(d.verdict == "reap" for d in decisions):
        return decisions
    parent: dict[int, int] = {}
    places: dict[int, list[tuple[Gpu, GpuProcess]]] = {}
    for gpu in snapshot.gpus:
        if gpu.lost or gpu.read_error is not None:
            continue
        for process in gpu.processes:
            places.setdefault(process.pid, []).append((gpu, process))
            if process.ppid is not None:
                parent[process.pid] = process.ppid
    out = []
    for d in decisions:
        busy = None
        if d.verdict == "reap":
            ranks = _siblings(d.candidate.pid, places, job_of)
            related = (_relatives(d.candidate.pid, parent) | ranks) & set(places)
            busy = next(
                (r for r in related if _worked(places.get(r, []), runs_for, now=now, rule=rule)),
                None,
            )
        if busy is None:
            out.append(d)
            continue
        kin = "parent" if parent.get(d.candidate.pid) == busy else "relative"
        if parent.get(busy) == d.candidate.pid:
            kin = "child"
        elif busy in ranks and busy not in _relatives(d.candidate.pid, parent):
            kin = "fellow rank"
        out.append(
            Decision(
                d.candidate,
                "spare",
                "active",
                f"its {kin} pid {busy} did GPU work within the window (it may use this "
                "process's memory)",
            )
        )
    return out


def _siblings(
    pid: int, places: dict[int, list[tuple[Gpu, GpuProcess]]], job_of: JobLookup | None
) -> set[int]:
    """The other ranks of ``pid``'s distributed job: GPU processes of the same user,
    with the same parent (a launcher: not init, nor a subreaper that adopted them) and
    the same ``job_of``. Two scripts a shell started are not linked: only a job's
    environment (torchrun's run id, a Slurm step, an MPI job) makes them one."""
    if job_of is None:
        return set()
    listed = places.get(pid)
    me = listed[0][1] if listed else None
    if me is None or me.ppid is None or me.ppid <= 1 or me.orphaned or me.owner.uid is None:
        return set()
    same = [
        other
        for other, where in places.items()
        if other != pid
        and where[0][1].ppid == me.ppid
        and not where[0][1].orphaned
        and where[0][1].owner.uid == me.owner.uid
    ]
    if not same:
        return set()
    job = job_of(pid)
    return set() if job is None else {other for other in same if job_of(other) == job}


def _relatives(pid: int, parent: dict[int, int]) -> set[int]:
    """The ancestors and descendants of ``pid`` that ``parent`` (pid -> ppid, of GPU
    processes) links it to; a chain through a process without a GPU context ends there."""
    out: set[int] = set()
    up, seen = parent.get(pid), {pid}
    while up is not None and up not in seen:
        seen.add(up)
        out.add(up)
        up = parent.get(up)
    children = {pid}
    while True:
        more = {c for c, p in parent.items() if p in children and c not in children}
        if not more:
            break
        children |= more
    return (out | children) - {pid}


def _worked(
    places: list[tuple[Gpu, GpuProcess]],
    runs_for: RunsLookup | None,
    *,
    now: float,
    rule: IdleRule,
) -> bool:
    """Whether the process listed at ``places`` did (or may have done) GPU work in the
    window: active now, or a history that is not idle all along (no history: unknown)."""
    begin = now - rule.window_seconds
    for gpu, process in places:
        ratio = activity_ratio(process, gpu)
        if ratio is None or ratio > 0:
            return True
        runs = None if runs_for is None else runs_for(gpu.uuid, process.pid, process.start_time)
        if not runs or runs[0].start > begin:
            return True  # not watched for the whole window: it may have worked
        if any(r.activity != "idle" and r.end >= begin for r in runs):
            return True
    return False


def candidates_from(
    snapshot: HostSnapshot,
    runs_for: RunsLookup | None,
    *,
    now: float,
    rule: IdleRule,
    held_on: HeldLookup | None = None,
) -> list[Candidate]:
    """One candidate per PID, holding one entry per GPU, each with its idle evidence.

    The memory floor is judged on the GPU where the process holds the most; on its
    other GPUs it only has to be idle (stopping it frees all of them).

    Activity in ``snapshot`` itself vetoes, whatever the history says: the history can
    lag this poll by up to a poll interval, and this poll is the newest look at the GPU.
    A GPU it held memory on that this poll cannot read is an unreadable holding
    (:func:`_unreadable_holdings`), which spares it.
    """
    first: dict[int, GpuProcess] = {}
    # pid -> GPU index -> (GPU UUID, bytes held, MIG GPU instance id)
    held: dict[int, dict[int, tuple[str, int | None, int | None]]] = {}
    busy_now: dict[tuple[int, int], float] = {}  # (pid, gpu index) -> activity seen now
    unreadable = [g for g in snapshot.gpus if g.lost or g.read_error is not None]
    for gpu in snapshot.gpus:
        if gpu.lost or gpu.read_error is not None:
            continue
        for process in gpu.processes:
            first.setdefault(process.pid, process)
            per_gpu = held.setdefault(process.pid, {})
            previous = per_gpu.get(gpu.index)
            used = process.used_bytes
            if previous is not None and previous[1] is not None and used is not None:
                used = max(used, previous[1])
            elif previous is not None:
                used = None
            instance = process.gpu_instance_id
            if previous is not None and previous[2] != instance:
                instance = None  # two contexts that disagree: which instance is unknown
            per_gpu[gpu.index] = (gpu.uuid, used, instance)
            ratio = activity_ratio(process, gpu)
            if ratio is not None and ratio > 0:
                key = (process.pid, gpu.index)
                busy_now[key] = max(busy_now.get(key, 0.0), ratio)
    out = []
    for pid, process in first.items():
        gpus = held[pid]
        largest = max(gpus, key=lambda index: gpus[index][1] or 0)
        holdings = tuple(
            Holding(
                gpu_index=index,
                gpu_uuid=uuid,
                used_bytes=used,
                gpu_instance_id=instance,
                evidence=_active_now(busy_now.get((pid, index)))
                or _evidence(
                    runs_for,
                    uuid,
                    process,
                    now=now,
                    rule=rule,
                    min_bytes=rule.min_memory_bytes if index == largest else 0,
                ),
            )
            for index, (uuid, used, instance) in sorted(gpus.items())
        ) + _unreadable_holdings(snapshot, unreadable, runs_for, held_on, process)
        out.append(
            Candidate(
                pid=pid,
                start_time=process.start_time,
                uid=process.owner.uid,
                user=process.owner.user,
                name=process.name,
                command=process.command,
                holdings=holdings,
                alive=process.alive,
                visible=process.visible,
                orphaned=process.orphaned,
                jupyter_kernel=process.jupyter_kernel,
                owner=process.owner,
            )
        )
    return out


def _active_now(ratio: float | None) -> IdleEvidence | None:
    """The verdict when this run's own poll saw activity; ``None`` when it did not."""
    if ratio is None:
        return None
    return IdleEvidence(False, "active", f"active now (busiest engine {ratio:.0%} in this poll)")


def _unreadable_holdings(
    snapshot: HostSnapshot,
    unreadable: list[Gpu],
    runs_for: RunsLookup | None,
    held_on: HeldLookup | None,
    process: GpuProcess,
) -> tuple[Holding, ...]:
    """GPUs where the history has this process and that this poll cannot read: lost
    or with a read error (by the UUID the snapshot gives them), or, by the history's
    own list (``held_on``), any GPU of its that is not a readable GPU of this poll: one
    that only a placeholder UUID names (``GPU-unknown-N``: never read by this reader,
    as after a restart) or that the poll no longer lists at all. It may still hold
    memory and be busy there, and nobody can tell, so each is an unreadable holding
    (idleness unknown), which spares the process."""
    if runs_for is None:
        return ()
    places = {
        gpu.index: gpu.uuid
        for gpu in unreadable
        if runs_for(gpu.uuid, process.pid, process.start_time)
    }
    if held_on is not None:
        readable = readable_uuids(snapshot)
        for index, uuid in held_on(process.pid, process.start_time):
            if uuid not in readable:
                places.setdefault(index, uuid)
    return tuple(
        Holding(
            gpu_index=index,
            gpu_uuid=uuid,
            used_bytes=None,
            readable=False,
            evidence=IdleEvidence(
                False,
                "unknown",
                f"it also held GPU {index}, which cannot be read now (lost, an NVML "
                "error, or no longer listed): its memory and activity there are unknown",
            ),
        )
        for index, uuid in sorted(places.items())
    )


def readable_uuids(snapshot: HostSnapshot) -> set[str]:
    """The UUIDs of the GPUs ``snapshot`` could read (listed, not lost, no read error)."""
    return {g.uuid for g in snapshot.gpus if not g.lost and g.read_error is None}


def unreadable_gpus(snapshot: HostSnapshot, holdings: tuple[Holding, ...]) -> list[int]:
    """The indexes of ``holdings`` whose GPU (by UUID) ``snapshot`` cannot read now:
    lost, a read error, or not listed. Nothing is done on what cannot be seen."""
    readable = readable_uuids(snapshot)
    return sorted({h.gpu_index for h in holdings if h.gpu_uuid not in readable})


def _evidence(
    runs_for: RunsLookup | None,
    gpu_uuid: str,
    process: GpuProcess,
    *,
    now: float,
    rule: IdleRule,
    min_bytes: int,
) -> IdleEvidence:
    if runs_for is None:
        return IdleEvidence(
            False, "no_history", "no history to judge by (one sample is never enough)"
        )
    return _judged(
        runs_for(gpu_uuid, process.pid, process.start_time), rule, now=now, min_bytes=min_bytes
    )


def _judged(runs: list[Run] | None, rule: IdleRule, *, now: float, min_bytes: int) -> IdleEvidence:
    """``runs`` judged by ``rule`` up to ``now``: the one place its bounds are applied."""
    return idle_evidence(
        runs,
        now=now,
        window_seconds=rule.window_seconds,
        min_bytes=min_bytes,
        max_gap_seconds=rule.max_gap_seconds,
        min_coverage=rule.min_coverage,
        max_age_seconds=rule.max_age_seconds,
    )


def _second_look(
    decision: Decision,
    runs_for: RunsLookup,
    server: ServerLookup,
    *,
    now: float,
    rule: IdleRule,
    selection: Selection,
    protections: Protections,
    caller_uid: int | None,
) -> Decision:
    """``decision`` again, with the server's history before the agent's, when only a
    history shorter than the window spares it (every other check passed, since idleness
    is checked last) and no GPU it holds is already known not to be idle."""
    c = decision.candidate
    holdings = c.holdings
    if (
        decision.verdict == "reap"
        or decision.reason not in SHORT_REASONS
        or c.start_time is None
        or any(not h.evidence.idle and h.evidence.reason not in SHORT_REASONS for h in holdings)
    ):
        return decision
    largest = c.largest.gpu_index
    changed = [
        _with_server(
            h, runs_for(h.gpu_uuid, c.pid, c.start_time), server, c,
            now=now, rule=rule, largest=largest,
        )
        for h in holdings
    ]  # fmt: skip
    (again,) = decide(
        [replace(c, holdings=tuple(changed))],
        selection=selection,
        protections=protections,
        caller_uid=caller_uid,
    )
    return again


def _with_server(
    h: Holding,
    agent: list[Run] | None,
    server: ServerLookup,
    c: Candidate,
    *,
    now: float,
    rule: IdleRule,
    largest: int,
) -> Holding:
    """``h`` judged on the server's runs before the agent's ``agent``, where that could
    change its verdict (:func:`~gpuwatch.agent.reaper.central.server_may_help`)."""
    begin = now - rule.window_seconds
    if h.evidence.idle or c.start_time is None or not server_may_help(agent, window_start=begin):
        return h
    earlier = server(
        gpu_index=h.gpu_index,
        gpu_uuid=h.gpu_uuid,
        pid=c.pid,
        start_time=c.start_time,
        since=begin,
    )
    if not earlier:
        return h
    evidence = _judged(
        combine(earlier, agent),
        rule,
        now=now,
        min_bytes=rule.min_memory_bytes if h.gpu_index == largest else 0,
    )
    where = (
        f"agent history for the last {format_duration(now - agent[0].start)}, the server's before"
        if agent
        else "from the server's history alone (the agent has none of it yet)"
    )
    return replace(h, evidence=replace(evidence, detail=f"{evidence.detail}; {where}"))


def rejudge(
    decision: Decision,
    runs_for: RunsLookup | None,
    *,
    now: float,
    planned_at: float,
    rule: IdleRule,
    used_now: dict[int, int | None],
    server: ServerLookup | None = None,
) -> Decision:
    """``decision`` judged again right before a signal: the history as it is *now*
    (``runs_for`` freshly read), idle up to ``now``, and the memory held ``used_now``
    (GPU index -> bytes, from the fresh NVML reading).

    ``reap`` only if every GPU it holds is still idle for the whole window, nothing on
    any of them was active, unknown or CPU-busy after the plan (``planned_at``), and
    its memory did not grow since the plan. Otherwise ``spare`` with the reason; the
    decision's figures (memory, idle stretch, detail) are those of ``now`` either way,
    for the audit row and the event. Nothing here is relaxed for a decision the plan
    made with the server's help: the same server lookup judges the same way.
    """
    c = decision.candidate
    largest = c.largest.gpu_index
    holdings = []
    spared: tuple[str, str] | None = None
    for h in c.holdings:
        used = used_now.get(h.gpu_index, h.used_bytes)
        runs = None if runs_for is None else runs_for(h.gpu_uuid, c.pid, c.start_time)
        evidence = (
            IdleEvidence(False, "no_history", "no history to judge by any more")
            if runs_for is None
            else _judged(
                runs,
                rule,
                now=now,
                min_bytes=rule.min_memory_bytes if h.gpu_index == largest else 0,
            )
        )
        fresh = replace(h, used_bytes=used, evidence=evidence)
        if server is not None and runs_for is not None and evidence.reason in SHORT_REASONS:
            fresh = _with_server(fresh, runs, server, c, now=now, rule=rule, largest=largest)
        holdings.append(fresh)
        if spared is not None:
            continue
        since_plan = [
            r for r in runs or () if r.end > planned_at and (r.activity != "idle" or r.cpu_busy)
        ]
        if since_plan:
            what = "CPU-busy" if since_plan[-1].activity == "idle" else since_plan[-1].activity
            spared = ("active", f"gpu{h.gpu_index}: {what} after the plan was made")
        elif (
            h.used_bytes is not None
            and used is not None
            and used - h.used_bytes > MEMORY_GROWTH_BYTES
        ):
            spared = ("active", f"gpu{h.gpu_index}: its memory grew since the plan was made")
        elif not fresh.evidence.idle:
            spared = (fresh.evidence.reason, f"gpu{h.gpu_index}: {fresh.evidence.detail}")
    again = replace(c, holdings=tuple(holdings))
    if spared is not None:
        return Decision(again, "spare", spared[0], spared[1])
    return Decision(again, "reap", decision.reason, again.largest.evidence.detail)
