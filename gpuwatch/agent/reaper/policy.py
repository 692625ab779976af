"""Who may be reaped, and why not: candidates + protections + filters -> decisions.

Pure: no clock, no ``/proc``, no NVML, no settings file. The planner
(:mod:`gpuwatch.agent.reaper.plan`) builds the candidates and their idle evidence;
:func:`decide` says ``reap`` or ``spare`` for each, with a reason code and a sentence.

Checks, in order; the first that applies decides, so the reason given is the
strongest one:

1. **Protections** (no flag turns these off, ``--force`` included): PID 1, gpuwatch
   itself, root and system users (uid <= ``system_uid_max``), display servers, and the
   site's allow-list of users, command patterns, cgroup patterns, Slurm jobs and pods.
2. **What cannot be signalled safely**: a process not visible from here (another PID
   namespace), one whose owner is unknown, one that has already exited, and, for a
   caller without root or ``CAP_KILL``, anyone else's process.
3. **The caller's filters**: ``--user``, ``--gpu``, ``--match`` / ``--exclude``,
   ``--only-orphans``, ``--min-memory``.
4. **Idleness**, on *every* GPU the process holds (stopping it frees all of them, so
   one busy GPU spares it): the verdict of :func:`~gpuwatch.agent.reaper.evidence.idle_evidence`.
   ``--force`` (only with ``--pid``) skips this step and no other, except on a GPU
   that cannot be read now: there nothing is known, so nothing is done.

A protection rests only on what an ordinary user cannot forge: the executable (not the
name) of a display server, the part of the cgroup path the user cannot name (not the
environment, nor directories below the user's own service manager or inside a container).
"""

from __future__ import annotations

import logging
import pwd
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Literal

from gpuwatch.agent.cgroup import parse_cgroup, undelegated
from gpuwatch.agent.reaper.evidence import IdleEvidence
from gpuwatch.agent.reaper.procfs import Executable, executable, login_uid_min, process_uids
from gpuwatch.agent.reaper.settings import ReapSettings
from gpuwatch.containers import container_label
from gpuwatch.snapshot import ProcessOwner

Verdict = Literal["reap", "spare"]

log = logging.getLogger(__name__)


def user_uid(name: str) -> int | None:
    """The uid of the account ``name`` on this host (``None``: there is none)."""
    try:
        return pwd.getpwnam(name).pw_uid
    except KeyError:
        return None


# gpuwatch itself is protected by PID (this command, its parent, the agent), never by
# its command line or name: any user can name a process "gpuwatch" or "Xorg".


# Reason codes, documented in docs/reaper.md. Protections first.
PROTECTED_REASONS = (
    "protected_pid1",
    "protected_self",
    "protected_root",
    "protected_system_user",
    "protected_display_server",
    "protected_user",
    "protected_command",
    "protected_cgroup",
    "protected_job",
)


@dataclass(frozen=True)
class Holding:
    """What a process holds on one GPU, and what the history says about it there.

    ``gpu_instance_id`` is the MIG GPU instance it runs in on that GPU (NVML's id, as
    ``MigInstance.gpu_instance_id``); ``None`` off MIG, or where NVML did not say.
    ``readable`` is False for a GPU the history has it on that cannot be read now
    (lost, an NVML error, no longer listed): what it holds and does there is unknown."""

    gpu_index: int
    gpu_uuid: str
    used_bytes: int | None
    evidence: IdleEvidence
    gpu_instance_id: int | None = None
    readable: bool = True


@dataclass(frozen=True)
class Candidate:
    """One process holding GPU memory, with the facts the decision reads.

    ``start_time`` is epoch seconds; ``uid`` the real uid (``None``: unknown).
    ``holdings`` has one entry per GPU it holds memory on.
    """

    pid: int
    start_time: float | None
    uid: int | None
    user: str | None
    name: str | None
    command: str | None
    holdings: tuple[Holding, ...]
    alive: bool = True
    visible: bool = True
    orphaned: bool = False
    jupyter_kernel: bool = False
    owner: ProcessOwner = field(default_factory=ProcessOwner)

    @property
    def memory_bytes(self) -> int:
        """Known bytes held on all GPUs (a ``None`` holding adds nothing)."""
        return sum(h.used_bytes or 0 for h in self.holdings)

    @property
    def largest(self) -> Holding:
        """The GPU where it holds the most (the one the floor is judged on)."""
        return max(self.holdings, key=lambda h: h.used_bytes or 0)

    @property
    def gpus(self) -> list[int]:
        return sorted(h.gpu_index for h in self.holdings)

    @property
    def workload(self) -> str | None:
        """Container / pod / job, for the table: the most specific the agent knows."""
        o = self.owner
        if o.slurm_job_id:
            return f"job {o.slurm_job_id}"
        if o.pod_uid:
            return f"pod {o.pod_uid[:8]}"
        if o.container_id:
            return container_label(o.container_runtime, o.container_id)
        return None


@dataclass(frozen=True)
class Protections:
    """The site's protections (``[agent.reap]``) plus the running gpuwatch's own PIDs."""

    system_uid_max: int = 999
    users: frozenset[str] = frozenset()
    commands: tuple[re.Pattern[str], ...] = ()
    cgroups: tuple[re.Pattern[str], ...] = ()
    slurm_jobs: frozenset[str] = frozenset()
    pods: frozenset[str] = frozenset()
    display_servers: frozenset[str] = frozenset()
    self_pids: frozenset[int] = frozenset()
    # pid -> its executable (procfs.executable); None: judge display servers by name
    # alone (pure callers and tests with no real processes).
    executable: Callable[[int], Executable | None] | None = None
    # UID_MIN of /etc/login.defs: uids below it are root and system accounts, which an
    # ordinary user cannot run a process as.
    login_uid_min: int = 1000
    # pid -> its real, effective and saved uids now (procfs.process_uids); None: the
    # candidate's uid alone (pure callers and tests with no real processes).
    uids: Callable[[int], tuple[int, ...]] | None = None

    @classmethod
    def from_settings(
        cls, settings: ReapSettings, *, self_pids: Iterable[int], proc_root: Path | None = None
    ) -> Protections:
        """``proc_root`` given: display servers are recognised by their executable.
        A protected user name that names no account here is logged: it protects nobody
        on this host (a typo, or a config shared with hosts that have it)."""
        for name in settings.protected_users:
            if not name.isdigit() and user_uid(name) is None:
                log.warning(
                    "[agent.reap] protected_users: %r is no user on this host; it protects "
                    "nobody here (a typo?)",
                    name,
                )
        return cls(
            executable=None if proc_root is None else partial(executable, proc_root=proc_root),
            uids=None if proc_root is None else partial(process_uids, proc_root=proc_root),
            system_uid_max=settings.system_uid_max,
            users=frozenset(settings.protected_users),
            commands=tuple(re.compile(p) for p in settings.protected_commands),
            cgroups=tuple(re.compile(p) for p in settings.protected_cgroups),
            slurm_jobs=frozenset(settings.protected_slurm_jobs),
            pods=frozenset(settings.protected_pods),
            display_servers=frozenset(settings.display_servers),
            self_pids=frozenset(self_pids),
            login_uid_min=login_uid_min(),
        )


@dataclass(frozen=True)
class Selection:
    """What the caller asked for. ``users`` / ``gpus`` empty: all. ``pid``: only that one."""

    window_seconds: float
    min_memory_bytes: int
    users: frozenset[str] = frozenset()
    gpus: frozenset[int] = frozenset()
    match: re.Pattern[str] | None = None
    exclude: re.Pattern[str] | None = None
    only_orphans: bool = False
    pid: int | None = None
    force: bool = False


@dataclass(frozen=True)
class Decision:
    """``reap`` or ``spare`` for one candidate; ``reason`` is a code, ``detail`` a sentence."""

    candidate: Candidate
    verdict: Verdict
    reason: str
    detail: str

    @property
    def idle_seconds(self) -> float | None:
        """The shortest idle stretch over its GPUs (``None`` when one has none)."""
        values = [h.evidence.idle_seconds for h in self.candidate.holdings]
        return None if any(v is None for v in values) else min(v for v in values if v is not None)

    @property
    def coverage_ratio(self) -> float | None:
        values = [h.evidence.coverage_ratio for h in self.candidate.holdings]
        return None if any(v is None for v in values) else min(v for v in values if v is not None)


def decide(
    candidates: Sequence[Candidate],
    *,
    selection: Selection,
    protections: Protections,
    caller_uid: int | None,
) -> list[Decision]:
    """One decision per candidate, in the order given.

    ``caller_uid`` is ``None`` when the caller may signal anyone (root or
    ``CAP_KILL``); otherwise only processes with that real uid can be reaped.
    """
    out = []
    for c in candidates:
        spared = (
            protection(c, protections)
            or _unsafe(c, caller_uid)
            or _filtered(c, selection)
            or _not_idle(c, selection)
        )
        if spared is not None:
            out.append(Decision(c, "spare", *spared))
        elif selection.force and not all(h.evidence.idle for h in c.holdings):
            out.append(Decision(c, "reap", "forced", "--force: stopped without proof of idleness"))
        else:
            detail = "; ".join(
                h.evidence.detail
                if len(c.holdings) == 1
                else f"gpu{h.gpu_index}: {h.evidence.detail}"
                for h in c.holdings
            )
            out.append(Decision(c, "reap", "idle", detail))
    return out


def protection(c: Candidate, p: Protections) -> tuple[str, str] | None:
    """Why ``c`` is protected, or ``None``. Nothing the caller passes changes this."""
    command = c.command or ""
    if c.pid == 1:
        return "protected_pid1", "PID 1 (init) is never signalled"
    if c.pid in p.self_pids:
        return "protected_self", "gpuwatch itself is never signalled"
    uids = _uids(c, p)
    if 0 in uids:
        kind = _uid_kind(c, 0)
        return "protected_root", f"runs as uid 0 ({kind}): root's processes are never reaped"
    system = sorted(u for u in uids if u <= p.system_uid_max)
    if system:
        kind = _uid_kind(c, system[0])
        return (
            "protected_system_user",
            f"system user (uid {system[0]} <= {p.system_uid_max}, {kind})",
        )
    display = _display_server(c, p)
    if display is not None:
        return "protected_display_server", f"display server {display}"
    if (c.user is not None and c.user in p.users) or (c.uid is not None and str(c.uid) in p.users):
        return "protected_user", f"user {c.user or c.uid} is on the protected list"
    for pattern in p.commands:
        if pattern.search(command):
            return "protected_command", f"command matches protected pattern {pattern.pattern!r}"
    # Only what no tenant named counts (gpuwatch.agent.cgroup.undelegated): below a
    # user's manager or a container, a protected job, pod or pattern can be forged.
    cgroup = undelegated(c.owner.cgroup or "")
    for pattern in p.cgroups:
        if pattern.search(cgroup):
            return "protected_cgroup", f"cgroup matches protected pattern {pattern.pattern!r}"
    # The job and pod as the cgroup says, never as the owner reports them: the owner's
    # Slurm job id may come from the environment, which the process sets itself.
    owner = parse_cgroup(f"0::{cgroup}") if cgroup else None
    if owner is not None and owner.slurm_job_id is not None and owner.slurm_job_id in p.slurm_jobs:
        return "protected_job", f"Slurm job {owner.slurm_job_id} is protected"
    if owner is not None and owner.pod_uid is not None and owner.pod_uid in p.pods:
        return "protected_job", f"pod {owner.pod_uid} is protected"
    return None


def _uids(c: Candidate, p: Protections) -> set[int]:
    """Every uid ``c`` runs as: its real uid, and its effective and saved ones where
    ``/proc`` can be read. A setuid-root helper (``Uid: 1001 0 0 0``) runs as root
    whatever its real uid, and is protected like root's own."""
    uids = {c.uid} if c.uid is not None else set()
    if p.uids is not None:
        uids.update(p.uids(c.pid))
    return uids


def _uid_kind(c: Candidate, uid: int) -> str:
    return "real uid" if c.uid == uid else "effective or saved uid"


def _display_server(c: Candidate, p: Protections) -> str | None:
    """The display server ``c`` is, or ``None``. The name (comm) is the process's to
    set (PR_SET_NAME), so where its executable can be read, that decides: a system
    binary named like a display server. Where it cannot be read (the policy runs
    without the right to read other users' executables), the name counts only for a
    process of root or a system account (uid below ``login_uid_min``), which an
    ordinary user cannot run a process as: otherwise anyone could claim it."""
    exe = None if p.executable is None else p.executable(c.pid)
    if exe is not None:
        return exe.name if exe.system and exe.name in p.display_servers else None
    system_account = c.uid is not None and c.uid < p.login_uid_min
    return c.name if system_account and c.name in p.display_servers else None


def _unsafe(c: Candidate, caller_uid: int | None) -> tuple[str, str] | None:
    if not c.visible:
        # The sampler reports a PID gone from /proc as dead only at its second poll in a
        # row, and a reap plans on one: a process that just exited is not visible yet.
        return (
            "not_visible",
            "PID not in /proc here: another PID namespace, or it exited since NVML listed it",
        )
    if not c.alive:
        return "not_alive", "already exited; NVML still lists its memory (a driver-side leak)"
    if c.uid is None or c.start_time is None:
        return "unknown_owner", "owner or start time unknown: its identity cannot be checked"
    if caller_uid is not None and c.uid != caller_uid:
        return "not_own_process", "another user's process (without root you can reap only your own)"
    return None


def _filtered(c: Candidate, s: Selection) -> tuple[str, str] | None:
    if s.pid is not None and c.pid != s.pid:
        return "not_target", f"not PID {s.pid}"
    if s.users and (c.user not in s.users and str(c.uid) not in s.users):
        return "filtered_user", "not one of the --user users"
    if s.gpus and not s.gpus.intersection(c.gpus):
        return "filtered_gpu", "not on a --gpu GPU"
    command = c.command or c.name or ""
    if s.match is not None and not s.match.search(command):
        return "filtered_command", f"command does not match --match {s.match.pattern!r}"
    if s.exclude is not None and s.exclude.search(command):
        return "filtered_command", f"command matches --exclude {s.exclude.pattern!r}"
    if s.only_orphans and not c.orphaned:
        return "not_orphan", "not orphaned (--only-orphans)"
    largest = c.largest.used_bytes
    if largest is None or largest < s.min_memory_bytes:
        return "below_min_memory", "holds less than the memory floor on every GPU"
    return None


def _not_idle(c: Candidate, s: Selection) -> tuple[str, str] | None:
    # --force waives the proof of idleness, not sight: on a GPU that cannot be read its
    # memory and activity are unknown, and whether a stop freed anything cannot be seen.
    holdings = [h for h in c.holdings if not h.readable] if s.force else c.holdings
    for h in holdings:
        if not h.evidence.idle:
            where = f"gpu{h.gpu_index}: " if len(c.holdings) > 1 else ""
            return h.evidence.reason, where + h.evidence.detail
    return None
