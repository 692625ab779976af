"""Fresh, uncached reads of one process from ``/proc``, for the reaper's identity checks.

:class:`~gpuwatch.agent.procinfo.ProcInfo` caches what cannot change in a process's
life and is owned by the sampler's thread. The reaper needs the opposite: a read taken
*now*, right before a signal, that says whether PID *n* is still the process the
decision was about. This module reads ``<proc_root>/<pid>/stat`` (state, start time,
CPU time) and ``status`` (real, effective and saved uids) and nothing else, with no cache.

Identity is ``(pid, start time, uid)``: a reused PID always has a later start time.
The uid must be the process's real, effective *and* saved uid: a process that ran a
setuid binary (``Uid: 1001 0 0 0``) is no longer only its user's, and one that did so
between the plan and the signal is not the process the plan was about.
Start times are compared in epoch seconds computed from the same boot time
(``btime``) as the sampler's, within :data:`START_TIME_TOLERANCE_SECONDS`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from gpuwatch.agent.procinfo import DEFAULT_PROC_ROOT, read_boot_time

# Start times are ``btime + ticks / CLK_TCK`` on both sides, from the same btime, so
# they agree exactly; half a tick absorbs float rounding and nothing else. A PID reused
# even 10 ms later has another start time. (A wall-clock step between two reads of
# btime makes a process look changed: the reaper then refuses, the safe side.)
START_TIME_TOLERANCE_SECONDS = 0.5 / os.sysconf("SC_CLK_TCK")


def same_start(a: float | None, b: float | None) -> bool:
    """True when two start times (epoch seconds) name the same process start."""
    return a is not None and b is not None and abs(a - b) <= START_TIME_TOLERANCE_SECONDS


_EXITED = frozenset({"Z", "X", "x"})


@dataclass(frozen=True, slots=True)
class ProcState:
    """One read of ``/proc/<pid>``. ``start_time`` is epoch seconds (``None`` without a
    boot time); ``cpu_seconds`` is user + system time; ``uid`` the real uid, ``uids``
    the real, effective and saved ones (empty: unreadable)."""

    pid: int
    name: str
    state: str
    start_ticks: int
    start_time: float | None
    cpu_seconds: float
    uid: int | None
    uids: tuple[int, ...] = ()

    @property
    def exited(self) -> bool:
        """A zombie or dead task: it has released its GPU context and cannot be stopped."""
        return self.state in _EXITED

    def matches(self, *, start_time: float | None, uid: int | None) -> bool:
        """True when this is the process observed with ``start_time`` and ``uid``.

        An unknown expected start time or uid never matches: without them a reused PID
        cannot be told apart, and the reaper does not act on what it cannot tell. Every
        one of its real, effective and saved uids must be ``uid``.
        """
        if start_time is None or self.start_time is None or uid is None or self.uid is None:
            return False
        same_user = self.uid == uid and all(u == uid for u in self.uids)
        return abs(self.start_time - start_time) <= START_TIME_TOLERANCE_SECONDS and same_user


class ProcReader:
    """Reads processes under ``proc_root`` (a host ``/proc`` bind mount works too)."""

    def __init__(self, proc_root: Path = DEFAULT_PROC_ROOT, *, boot_time: float | None = None):
        self.root = proc_root
        self._boot_time = boot_time if boot_time is not None else read_boot_time(proc_root)
        self._ticks = os.sysconf("SC_CLK_TCK")

    @property
    def boot_time(self) -> float | None:
        """The btime (epoch seconds) its start times are computed from, read once."""
        return self._boot_time

    def read(self, pid: int) -> ProcState | None:
        """The process now, or ``None`` when there is no such PID (or it vanished mid-read)."""
        stat = self._stat(pid)
        if stat is None:
            return None
        try:
            with open(f"{self.root}/{pid}/status", "rb") as file:
                status = file.read().decode("utf-8", errors="replace")
        except OSError:
            return None
        name, state, cpu_ticks, start = stat
        return ProcState(
            pid=pid,
            name=name,
            state=state,
            start_ticks=start,
            start_time=None if self._boot_time is None else self._boot_time + start / self._ticks,
            cpu_seconds=cpu_ticks / self._ticks,
            uid=_real_uid(status),
            uids=_uids(status),
        )

    def cpu_seconds(self, pid: int) -> float | None:
        """User + system CPU seconds of ``pid`` so far; ``None`` when gone or unreadable.

        One read of ``stat`` only: the history calls this for idle-looking processes on
        every poll.
        """
        stat = self._stat(pid)
        if stat is None or stat[1] in _EXITED:
            return None
        return stat[2] / self._ticks

    def _stat(self, pid: int) -> tuple[str, str, int, int] | None:
        """``(comm, state, utime + stime, starttime)`` from ``stat``; ticks. ``None`` if gone."""
        if pid <= 0:
            return None
        try:
            with open(f"{self.root}/{pid}/stat", "rb") as file:
                text = file.read().decode("utf-8", errors="replace")
        except OSError:
            return None
        # comm may hold spaces and parentheses: split at the last ')'.
        head, sep, tail = text.rpartition(")")
        fields = tail.split()
        if not sep or len(fields) < 20 or "(" not in head:
            return None
        try:
            # proc(5) fields 3, 14, 15, 22: state, utime, stime, starttime.
            cpu = int(fields[11]) + int(fields[12])
            return head[head.find("(") + 1 :], fields[0], cpu, int(fields[19])
        except ValueError:
            return None


def _real_uid(status: str) -> int | None:
    for line in status.splitlines():
        if line.startswith("Uid:"):
            parts = line.split()
            return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else None
    return None


def _uids(status: str) -> tuple[int, ...]:
    """The real, effective and saved uids of a ``status`` text (empty: unreadable)."""
    for line in status.splitlines():
        if line.startswith("Uid:"):
            parts = line.split()[1:4]
            return tuple(int(p) for p in parts) if all(p.isdigit() for p in parts) else ()
    return ()


def process_uids(pid: int, proc_root: Path = DEFAULT_PROC_ROOT) -> tuple[int, ...]:
    """The real, effective and saved uids of ``pid`` now (empty: gone or unreadable)."""
    try:
        with open(f"{proc_root}/{pid}/status", "rb") as file:
            return _uids(file.read().decode("utf-8", errors="replace"))
    except OSError:
        return ()


CAP_KILL = 5  # linux/capability.h


def may_signal_anyone(proc_root: Path = DEFAULT_PROC_ROOT) -> bool:
    """True for root, or a process whose effective capabilities include ``CAP_KILL``
    (the agent under its systemd drop-in)."""
    if os.geteuid() == 0:
        return True
    try:
        status = (proc_root / "self" / "status").read_text(encoding="ascii", errors="replace")
    except OSError:
        return False
    for line in status.splitlines():
        if line.startswith("CapEff:"):
            try:
                return bool(int(line.split()[1], 16) >> CAP_KILL & 1)
            except (IndexError, ValueError):
                return False
    return False


@dataclass(frozen=True)
class Executable:
    """What ``/proc/<pid>/exe`` points to: the file's name, and whether it is a system
    binary (owned by root, in a root-owned directory that no one else may write), which
    an ordinary user can neither create nor rename."""

    name: str
    system: bool


def executable(pid: int, proc_root: Path = DEFAULT_PROC_ROOT) -> Executable | None:
    """The executable ``pid`` runs (``None``: gone, or not ours to look at)."""
    link = proc_root / str(pid) / "exe"
    try:
        path = os.readlink(link)
        binary = os.stat(link)  # the running file itself, even if renamed since
        directory = os.stat(os.path.dirname(path.removesuffix(" (deleted)")) or "/")
    except OSError:
        return None
    system = binary.st_uid == 0 and directory.st_uid == 0 and not directory.st_mode & 0o022
    return Executable(os.path.basename(path.removesuffix(" (deleted)")), system)


LOGIN_DEFS = Path("/etc/login.defs")
DEFAULT_UID_MIN = 1000  # shadow-utils' default when login.defs does not say


def login_uid_min(path: Path = LOGIN_DEFS) -> int:
    """``UID_MIN`` from ``login.defs``: the lowest uid of an ordinary user (the default
    when the file or the key is missing or malformed). Below it are root and the system
    accounts, which an ordinary user cannot run a process as."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return DEFAULT_UID_MIN
    for line in text.splitlines():
        fields = line.split()
        if (
            len(fields) >= 2
            and fields[0] == "UID_MIN"
            and fields[1].isascii()
            and fields[1].isdigit()
        ):
            return int(fields[1])
    return DEFAULT_UID_MIN


# Environment variables that name one distributed job, and every rank of it carries:
# torchrun / torch.distributed.elastic, a Slurm job step, an MPI job (PMIx, Open MPI).
_JOB_VARIABLES = (
    ("TORCHELASTIC_RUN_ID",),
    ("SLURM_JOB_ID", "SLURM_STEP_ID"),
    ("PMIX_NAMESPACE",),
    ("OMPI_MCA_orte_hnp_uri",),
    ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE"),
)
_ENVIRON_MAX_BYTES = 1 << 20


def job_key(pid: int, proc_root: Path = DEFAULT_PROC_ROOT) -> str | None:
    """The distributed job ``pid`` is a rank of, from its environment (``None``: none,
    or the environment cannot be read: another user's, without root). Used only to
    *spare* a process whose fellow ranks work, so a user who sets these variables can
    only keep their own processes from being stopped."""
    try:
        with open(f"{proc_root}/{pid}/environ", "rb") as file:
            data = file.read(_ENVIRON_MAX_BYTES)
    except OSError:
        return None
    env: dict[str, str] = {}
    for item in data.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            env.setdefault(key.decode("utf-8", "replace"), value.decode("utf-8", "replace"))
    for names in _JOB_VARIABLES:
        if all(env.get(n) for n in names):
            return " ".join(f"{n}={env[n]}" for n in names)
    return None
