"""Who a GPU process is, from ``/proc``: name, command, user, container/pod/job, orphan status.

NVML gives the agent bare PIDs. :class:`ProcInfo` turns each into :class:`ProcessFacts` by
reading ``<proc_root>/<pid>/{stat,status,cmdline,cgroup,environ}`` directly (no psutil), so
tests can point it at a fixture tree and a container can point it at a bind-mounted host
``/proc``.

**Orphans.** A process is *orphaned* when the parent that started it is gone and nothing that
still runs owns it: the training run whose SSH shell died, the worker whose launcher crashed.
``/proc`` does not record the original parent, so this is inferred, and the inference leans
towards "not orphaned" because orphan status feeds alerts and the reaper:

1. *Reparented*: the kernel hands a dead parent's children to the nearest child subreaper in
   the same PID namespace, or to that namespace's PID 1. So: ``ppid == 1``; or the parent is
   PID 1 of its own namespace (its ``NSpid`` ends in 1: a container's init, seen from the
   host); or the parent's ``comm`` is a known subreaper (:data:`DEFAULT_SUBREAPERS`:
   ``systemd`` covers ``systemd --user``; ``/proc`` cannot say whether a process set
   ``PR_SET_CHILD_SUBREAPER``, hence a list). ``ppid == 0`` means the parent is outside this
   PID namespace, which proves nothing.
2. *Not a deliberate detachment*: being a child of init is also what daemons, systemd services
   and container entrypoints look like. So a process is not orphaned when
   ``sid == pid`` (it called ``setsid()``: daemons, every unit systemd starts, container inits,
   ``setsid cmd``), when ``sid == ppid`` (it runs in its reaper's own session: ``tini`` starts
   its one child that way, so it was never reparented), or when its cgroup is a system
   ``.service`` unit (systemd tracks the whole unit, so an old-style double-forking daemon
   whose intermediate parent exited is still owned by its unit). The shell-died case passes
   all three: its session leader was the dead shell.
3. *Supervised children* are the exception to ``sid == pid`` in rule 2: ``jupyter_client``
   starts every kernel, and ``torchrun`` (TorchElastic's ``SubprocessHandler``) every worker,
   with ``start_new_session=True``, so their own session tells nothing. A kernel (by its
   command line) or a TorchElastic worker (``TORCHELASTIC_RUN_ID`` in its environment) that
   was adopted has lost its server or agent and is orphaned. For them only ``ppid == 1`` or a
   known subreaper counts as adoption, not a parent that is merely its namespace's PID 1: a
   container whose entrypoint *is* ``jupyter lab``, ``torchrun`` or ``papermill`` is that
   child's live launcher, and nothing in ``/proc`` tells it from an adopter. ``sid == ppid``
   still clears them (started in the reaper's own session, so never reparented).

Known misses: a job left behind by a shell that ran in a ``tini`` container's session is
not reported (it shares its reaper's session), the safe side; a kernel or worker adopted by a
container PID 1 that is not a known subreaper (``bash``) is not reported, the safe side; a
classic double-forking daemon outside any service unit is reported, which is rare today
(systemd starts most daemons).

**Liveness.** A zombie holds no GPU context, except a zombie *thread-group leader* whose other
threads still run (the main thread called ``pthread_exit``; ``ps`` shows ``Zl``): its PID is
the one NVML lists, so it is alive while ``Threads`` in ``status`` is above 1. Such a leader's
own ``cmdline`` is empty and, on cgroup v1, its ``cgroup`` reads ``/`` (its memory map and
cgroups went with it), so those, and ``environ``, are read from a live thread's
``task/<tid>/``. Files are read one by one, so a process can exit, and its PID be reused,
between them: ``stat`` is read again after the identity, and a process whose start time
changed, that vanished or that is now exited (a zombie: same start time, emptied files) is
reported not alive, its half-read identity never cached.

**Only "no such process" means dead.** A ``stat`` read that fails with ENOENT or ESRCH means
the PID does not exist; any other error (EACCES or EPERM: ``/proc`` mounted ``hidepid=1``, a
read refused) means it exists and cannot be seen: ``alive=True, visible=False``, owner
unknown, which no detector judges. ``hidepid=2`` hides the directory itself (ENOENT), so when
``proc_root`` is the reader's own procfs a missing PID is confirmed with ``kill(pid, 0)``: EPERM
or success means it exists (hidden), ESRCH that it is gone. :attr:`ProcInfo.reader_notes`
says when the mount hides processes from this reader.

**Users.** The uid is the kernel's, translated out of the reader's user namespace, and the
name is the host's (:mod:`gpuwatch.agent.identity`): a subuid is named after the user who
owns it, an unmappable uid (the overflow uid in a user namespace) is unknown (``None``), and
a uid is shown as a number, never under another account's name. Only the uid is cached with
the process: the name is asked of :class:`~gpuwatch.agent.identity.UserNames` at every
describe, so a lookup that failed (sssd restarting) is retried as that class says instead of
leaving the process a number for its whole life.

**Bounds.** Every string of the owner is cut to the snapshot's bound where it is built
(:func:`_short`): a user name from NSS or a scenario, or a directory name a user chose
(kernfs accepts names far longer than ``NAME_MAX``), must never fail the snapshot's
validation and so cost the whole poll.

**PID namespaces.** NVML reports host (initial-namespace) PIDs: the driver is not
namespace-aware. When ``proc_root`` shows another namespace, a PID NVML reports is either
absent there or, worse, names an unrelated process that happens to have the same number. So
when :func:`pid_namespace_isolated` is true every PID is reported ``visible=False`` rather
than attributed to whoever holds that number locally; callers say "not visible from this
agent", never "no such process".

**Cost.** One describe reads ``stat``, and the parent's ``stat`` when the parent is not PID 1.
What cannot change during a process's life is read once and cached per ``(pid, start time)``;
a reused PID has a new start time and misses the cache. The command is cached as first seen:
exec does not change the start time, but a process holding a GPU context has long since
exec'd. Dead entries are swept when the cache doubles (see :meth:`ProcInfo.expire_dead`).
"""

from __future__ import annotations

import errno
import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from gpuwatch.agent.cgroup import MAX_NAME_CHARS, MAX_PATH_CHARS, CgroupOwner, parse_cgroup
from gpuwatch.agent.identity import UidMap, UserNames, read_uid_map
from gpuwatch.agent.notebooks import is_jupyter_kernel, is_jupyter_server
from gpuwatch.agent.proc_mounts import hiding_mount_option, is_own_procfs
from gpuwatch.errors import GpuwatchError
from gpuwatch.snapshot import ProcessOwner

log = logging.getLogger(__name__)

DEFAULT_PROC_ROOT = Path("/proc")
MAX_COMMAND_CHARS = 4096  # gpuwatch.snapshot.LongStr
# Enough bytes for MAX_COMMAND_CHARS characters even if each one is 4-byte UTF-8.
_MAX_CMDLINE_BYTES = 4 * MAX_COMMAND_CHARS

DEFAULT_SUBREAPERS = frozenset(
    {"systemd", "init", "tini", "tini-static", "docker-init", "dumb-init", "catatonit", "pause"}
)
# PROC_PID_INIT_INO in include/linux/proc_ns.h: the inode of the initial PID namespace.
_INIT_PID_NAMESPACE_INODE = 0xEFFFFFFC
# Zombie and dead tasks hold no GPU context any more (the driver releases it at exit).
_EXITED_STATES = frozenset({"Z", "X", "x"})
_MIN_SWEEP_SIZE = 256
_SLURM_JOB_ID = re.compile(rb"(?:^|\x00)SLURM_JOB_ID=(\d{1,20})(?:\x00|$)")
# Set by torchrun's agent in every worker's environment (LocalElasticAgent._start_workers).
_ELASTIC_WORKER = re.compile(rb"(?:^|\x00)TORCHELASTIC_RUN_ID=")


@dataclass(frozen=True, slots=True)
class ProcessFacts:
    """What ``/proc`` says about one PID. ``None`` means unknown, never empty or zero.

    ``alive`` is False for a PID that does not exist or has exited (a zombie). ``visible`` is
    False when this agent's ``/proc`` cannot show the PID: NVML's PIDs are in another PID
    namespace, or ``/proc`` hides it (``hidepid``, a read refused); ``alive`` is then True
    because NVML still lists the PID and nothing here can prove otherwise. ``start_time`` is
    epoch seconds (``ps -o lstart``); ``command`` is the argv joined with spaces (an empty
    argument as ``''``), at most 4096 characters.
    """

    pid: int
    alive: bool
    visible: bool = True
    name: str | None = None
    command: str | None = None
    start_time: float | None = None
    ppid: int | None = None
    user: str | None = None
    uid: int | None = None
    orphaned: bool = False
    jupyter_kernel: bool = False
    jupyter_server_alive: bool | None = None
    # Shared by every fact with no owner (dead PIDs are the common case on a busy GPU).
    owner: ProcessOwner = field(default=ProcessOwner())

    def to_gpu_process_fields(self) -> dict[str, Any]:
        """Keyword arguments for :class:`gpuwatch.snapshot.GpuProcess`, all but ``pid``.

        ``GpuProcess(pid=pid, used_bytes=used, **facts.to_gpu_process_fields())``. The owner is
        shared, not copied: :class:`ProcessOwner` is frozen.
        """
        return {
            "visible": self.visible,
            "alive": self.alive,
            "name": self.name,
            "command": self.command,
            "start_time": self.start_time,
            "ppid": self.ppid,
            "orphaned": self.orphaned,
            "jupyter_kernel": self.jupyter_kernel,
            "jupyter_server_alive": self.jupyter_server_alive,
            "owner": self.owner,
        }


@dataclass(frozen=True, slots=True)
class _Stat:
    """The fields of ``/proc/<pid>/stat`` gpuwatch uses; they can change between polls."""

    comm: str
    state: str
    ppid: int
    session: int
    start_ticks: int  # clock ticks after boot


@dataclass(frozen=True, slots=True)
class _Identity:
    """What stays fixed for one process lifetime: read once per ``(pid, start time)``."""

    name: str
    command: str | None
    uid: int | None
    # Who names the uid: a scenario's declared user, else UserNames at each describe (its
    # failed lookups are retried there), with the cgroup's host user manager for a subuid.
    declared_user: str | None
    manager_uid: int | None
    owner: ProcessOwner  # as last described: its user is replaced when the name changes
    jupyter_kernel: bool
    jupyter_server: bool
    elastic_worker: bool  # a torchrun worker: started in its own session by its agent
    namespace_init: bool  # PID 1 of its own PID namespace: it inherits that namespace's orphans


class _Hidden(Exception):
    """``/proc`` refused a read for a PID that exists (module docstring)."""


class ProcInfo:
    """Describes host PIDs from a ``/proc`` tree, caching per process lifetime.

    ``boot_time`` (epoch seconds) defaults to ``btime`` in ``<proc_root>/stat``;
    ``isolated`` defaults to :func:`pid_namespace_isolated` on ``proc_root`` (tests that
    describe their own children pass False); ``uid_map`` to the reader's user namespace
    (``<proc_root>/self/uid_map``). All are read once, here. ``user_names`` names uids (default:
    NSS, ``/etc/subuid``). ``subreapers`` are the ``comm`` names taken to be child subreapers.
    ``declared_users`` maps ``(pid, start ticks)`` to a user name that replaces the one
    ``/proc`` gives: only on simulated GPUs, where the scenario names each stand-in's owner
    (:mod:`gpuwatch.nvml.fake.owners`); the uid stays the real one. Not thread-safe: one
    sampler owns one instance.
    """

    def __init__(
        self,
        proc_root: Path = DEFAULT_PROC_ROOT,
        *,
        boot_time: float | None = None,
        isolated: bool | None = None,
        subreapers: frozenset[str] = DEFAULT_SUBREAPERS,
        declared_users: Mapping[tuple[int, int], str] | None = None,
        uid_map: UidMap | None = None,
        user_names: UserNames | None = None,
    ) -> None:
        self._root = proc_root
        self._declared_users = declared_users or {}
        self._root_prefix = str(proc_root)
        self._boot_time = boot_time if boot_time is not None else read_boot_time(proc_root)
        self._isolated = isolated if isolated is not None else pid_namespace_isolated(proc_root)
        self._uid_map = uid_map if uid_map is not None else read_uid_map(proc_root)
        self._names = user_names if user_names is not None else UserNames()
        # kill(pid, 0) can confirm that a PID missing from proc_root is gone only when
        # proc_root is this process's own procfs (same PID namespace).
        self._own_procfs = is_own_procfs(proc_root)
        self._subreapers = subreapers
        self._ticks_per_second = os.sysconf("SC_CLK_TCK")
        self._identities: dict[int, tuple[int, _Identity]] = {}
        self._sweep_at = _MIN_SWEEP_SIZE

    @property
    def pid_namespace_isolated(self) -> bool:
        """True when NVML's host PIDs are not visible here (``HostSnapshot`` has this field)."""
        return self._isolated

    @property
    def reader_notes(self) -> list[str]:
        """Why this reader may see less than the host has: hidden processes, uids it cannot
        map, names it cannot trust (for ``gpuwatch status`` and the agent's log)."""
        notes: list[str] = []
        hidepid = hiding_mount_option(self._root)
        if hidepid is not None:
            notes.append(
                f"{self._root} is mounted with {hidepid}: processes of other users are hidden"
                " from this reader and shown as hidden, owner unknown (run as root, or in"
                " the mount's gid= group)"
            )
        if self._uid_map.nested:
            notes.append(
                "this reader runs in a user namespace: uids it cannot map read as"
                f" {self._uid_map.overflow_uid} and their owners are shown as unknown"
            )
        if self._names.from_image:
            notes.append(
                "/etc/passwd is the container image's, not the host's: users are shown as"
                " uids (mount the host's /etc/passwd to name them)"
            )
        return notes

    def describe(self, pid: int) -> ProcessFacts:
        """Facts about host PID ``pid``; never raises for a missing or vanishing process."""
        if self._isolated:
            return ProcessFacts(pid=pid, alive=True, visible=False)
        try:
            stat = self._read_stat(pid)
            if stat is None and self._exists_unseen(pid):
                raise _Hidden(pid)
            identity = None
            if stat is not None and self._alive(pid, stat):
                identity = self._identity(pid, stat)
        except _Hidden:
            self._identities.pop(pid, None)
            return ProcessFacts(pid=pid, alive=True, visible=False)
        if stat is None or identity is None:
            self._identities.pop(pid, None)
            return ProcessFacts(pid=pid, alive=False)
        parent = self._peek_stat(stat.ppid) if stat.ppid > 1 else None
        reparented = self._adopted(stat, identity, parent)
        owner = self._owner(pid, stat, identity)
        return ProcessFacts(
            pid=pid,
            alive=True,
            name=identity.name,
            command=identity.command,
            start_time=self._epoch(stat.start_ticks),
            ppid=stat.ppid,
            user=owner.user,
            uid=identity.uid,
            orphaned=self._orphaned(pid, stat, identity, reparented),
            jupyter_kernel=identity.jupyter_kernel,
            jupyter_server_alive=self._server_alive(stat, identity, parent, reparented),
            owner=owner,
        )

    def _user(self, identity: _Identity) -> str | None:
        """The name of the identity's uid now (module docstring, "Users")."""
        if identity.declared_user is not None:
            return identity.declared_user
        if identity.uid is None:
            return None
        return _short(self._names.name(identity.uid, manager_uid=identity.manager_uid))

    def _owner(self, pid: int, stat: _Stat, identity: _Identity) -> ProcessOwner:
        """The cached owner, with the user named as :class:`UserNames` names it now. A name
        that changed (a retried lookup succeeded) is cached with the process; the frozen
        owner is otherwise shared, not rebuilt, poll after poll."""
        user = self._user(identity)
        if user == identity.owner.user:
            return identity.owner
        owner = identity.owner.model_copy(update={"user": user})
        self._identities[pid] = (stat.start_ticks, replace(identity, owner=owner))
        return owner

    def uptime(self) -> float | None:
        """Seconds since boot (``<proc_root>/uptime``), or None if unreadable."""
        first = (_read_text(self._root / "uptime") or "").split(" ", 1)[0]
        try:
            return float(first)
        except ValueError:
            return None

    def seconds_since_boot(self, start_time: float | None) -> float | None:
        """A process's start time (epoch seconds, as :meth:`describe` gives it) as seconds
        since boot, the clock :meth:`uptime` reads: a step of the wall clock moves
        neither."""
        if start_time is None or self._boot_time is None:
            return None
        return start_time - self._boot_time

    def expire_dead(self) -> int:
        """Forget cached processes that exited or whose PID was reused; returns how many.

        Runs by itself whenever the cache doubles, so a long-running agent stays bounded by
        the number of processes alive at once; callers may also run it once per poll.
        """
        gone = [
            pid
            for pid, (ticks, _) in self._identities.items()
            if (stat := self._peek_stat(pid)) is None
            or stat.start_ticks != ticks
            or not self._alive(pid, stat)
        ]
        for pid in gone:
            del self._identities[pid]
        self._sweep_at = max(_MIN_SWEEP_SIZE, 2 * len(self._identities))
        return len(gone)

    def _alive(self, pid: int, stat: _Stat) -> bool:
        """Not exited; a zombie leader whose other threads still run is alive (docstring)."""
        if stat.state not in _EXITED_STATES:
            return True
        threads = _status_field(_read_text(self._root / str(pid) / "status") or "", "Threads")
        return stat.state == "Z" and threads is not None and threads.isdigit() and int(threads) > 1

    def _adopted(self, stat: _Stat, identity: _Identity, parent: _Stat | None) -> bool:
        """Whether the parent looks like one that inherited the process (the orphan rule)."""
        if stat.session == stat.ppid:
            return False  # started in its reaper's own session: the reaper is its launcher
        if stat.ppid == 1:
            return True
        if parent is None:
            return False
        if parent.comm in self._subreapers:
            return True
        if _supervised(identity):
            return False  # a namespace init may be its launcher: see the module docstring
        parent_identity = self._identity(stat.ppid, parent)
        return parent_identity is not None and parent_identity.namespace_init

    def _orphaned(self, pid: int, stat: _Stat, identity: _Identity, reparented: bool) -> bool:
        """The orphan rule of the module docstring."""
        if not reparented:
            return False
        if _supervised(identity):
            return True
        unit = identity.owner.systemd_unit or ""
        # A Slurm job's task is the job's, even in slurmd.service's cgroup (proctrack/pgid
        # or linuxproc; v1 hierarchies that disagree): its step ended, the unit did not.
        service_owned = (
            unit.endswith(".service")
            and not unit.startswith("user@")
            and identity.owner.slurm_job_id is None
        )
        return stat.session != pid and not service_owned  # sid == ppid: see _adopted

    def _server_alive(
        self, stat: _Stat, identity: _Identity, parent: _Stat | None, reparented: bool
    ) -> bool | None:
        """For a kernel: True under a live Jupyter server, False once adopted, else unknown."""
        if not identity.jupyter_kernel:
            return None
        if parent is not None:
            launcher = self._identity(stat.ppid, parent)
            if launcher is not None and launcher.jupyter_server:
                return True  # even when the server is its container's PID 1
        if reparented:
            return False
        return None  # started by something else (an IDE, papermill) or parent not visible

    def _identity(self, pid: int, stat: _Stat) -> _Identity | None:
        """The cached identity, or a fresh read; ``None`` when the process changed mid-read."""
        cached = self._identities.get(pid)
        if cached is not None and cached[0] == stat.start_ticks:
            return cached[1]
        identity = self._read_identity(pid, stat)
        after = self._read_stat(pid)
        if after is None or after.start_ticks != stat.start_ticks or not self._alive(pid, after):
            # It exited (files half read: a zombie keeps its start time but not its
            # cmdline) or its PID was reused (files of another process).
            return None
        self._identities[pid] = (stat.start_ticks, identity)
        if len(self._identities) > self._sweep_at:
            self.expire_dead()
        return identity

    def _read_identity(self, pid: int, stat: _Stat) -> _Identity:
        base = self._root / str(pid)
        files = self._live_thread(base) if stat.state == "Z" else base
        argv = _read_argv(files / "cmdline")
        status = _read_text(base / "status") or ""
        seen_uid = real_uid(status)
        uid = None if seen_uid is None else self._uid_map.outside(seen_uid)
        nspid = (_status_field(status, "NSpid") or "").split()
        cgroup = parse_cgroup(_read_text(files / "cgroup") or "")
        declared = self._declared_users.get((pid, stat.start_ticks))
        environ = _read_environ(files / "environ")
        # The user is filled in by describe (_owner), which names the uid at every call.
        owner = _process_owner(cgroup, None, uid, _slurm_job_id(environ))
        command = " ".join(_shown(arg) for arg in argv)[:MAX_COMMAND_CHARS] or None
        return _Identity(
            name=_short(stat.comm),
            command=command,
            uid=uid,
            declared_user=_optional_short(declared),
            manager_uid=cgroup.user_manager_uid,
            owner=owner,
            jupyter_kernel=is_jupyter_kernel(argv),
            jupyter_server=is_jupyter_server(argv),
            elastic_worker=environ is not None and _ELASTIC_WORKER.search(environ) is not None,
            namespace_init=len(nspid) > 1 and nspid[-1] == "1",
        )

    def _live_thread(self, base: Path) -> Path:
        """``base/task/<tid>`` of a thread that has not exited, for a zombie leader whose
        threads still run; ``base`` itself when there is none."""
        try:
            tids = sorted(int(t) for t in os.listdir(base / "task") if t.isdigit())
        except OSError:
            return base
        for tid in tids:
            thread = base / "task" / str(tid)
            text = _read_text(thread / "stat")
            state = _parse_stat(text) if text is not None else None
            if state is not None and state.state not in _EXITED_STATES:
                return thread
        return base

    def _read_stat(self, pid: int) -> _Stat | None:
        """``None`` when there is no such process; raises :class:`_Hidden` when ``/proc``
        refuses the read (it exists: module docstring)."""
        # The hot path: every listed PID and its parent, every poll. A plain string path
        # and a binary read cost a fraction of pathlib's (see bench/agent.py).
        if pid <= 0:
            return None
        try:
            with open(f"{self._root_prefix}/{pid}/stat", "rb") as file:
                text = file.read().decode("utf-8", errors="replace")
        except OSError as err:
            if err.errno in (errno.ENOENT, errno.ESRCH):
                return None
            raise _Hidden(pid) from err
        return _parse_stat(text)

    def _peek_stat(self, pid: int) -> _Stat | None:
        """:meth:`_read_stat` for a process only looked at (a parent, a cache entry):
        hidden reads as absent."""
        try:
            return self._read_stat(pid)
        except _Hidden:
            return None

    def _exists_unseen(self, pid: int) -> bool:
        """A PID absent from ``proc_root`` that exists all the same (``hidepid=2``)."""
        if not self._own_procfs or pid <= 0:
            return False
        try:
            os.kill(pid, 0)  # signal 0: only checks that it exists and may be signalled
        except PermissionError:
            return True
        except OSError:
            return False
        return True

    def _epoch(self, start_ticks: int) -> float | None:
        if self._boot_time is None:
            return None
        return self._boot_time + start_ticks / self._ticks_per_second


def pid_namespace_isolated(proc_root: Path = DEFAULT_PROC_ROOT) -> bool:
    """True when ``proc_root`` cannot show the host PIDs that NVML reports.

    That is the case when this process runs in a nested PID namespace *and* ``proc_root`` is
    that namespace's own procfs (a container without ``--pid=host``). Two signals from
    ``<proc_root>/self``: the ``ns/pid`` link names the initial namespace (not isolated), or
    ``NSpid`` in ``status`` lists more than one PID, which happens only when the procfs was
    mounted in an ancestor namespace (a host ``/proc`` bind-mounted into the container; the
    ancestor is taken to be the host). Inside a container's own ``/proc``, ``NSpid`` has one
    entry, like on the host, so it cannot decide alone.
    """
    self_dir = proc_root / "self"
    try:
        link = os.readlink(self_dir / "ns" / "pid")
    except OSError as err:
        # No namespace links (no procfs here, or a pre-3.8 kernel): nothing says we are nested.
        log.debug("cannot read %s: %s", self_dir / "ns" / "pid", err)
        return False
    if _namespace_inode(link) == _INIT_PID_NAMESPACE_INODE:
        return False
    nspid = _status_field(_read_text(self_dir / "status") or "", "NSpid")
    return nspid is None or len(nspid.split()) <= 1


def read_boot_id(proc_root: Path = DEFAULT_PROC_ROOT) -> str:
    """This boot's random id (``/proc/sys/kernel/random/boot_id``), stripped.

    Raises :class:`~gpuwatch.errors.GpuwatchError` when it cannot be read: without it
    snapshots cannot be told apart across reboots.
    """
    path = proc_root / "sys" / "kernel" / "random" / "boot_id"
    try:
        return path.read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError) as err:
        raise GpuwatchError(f"cannot read the boot id from {path}: {err}") from err


def read_boot_time(proc_root: Path = DEFAULT_PROC_ROOT) -> float | None:
    """Boot time in epoch seconds (``btime`` in ``/proc/stat``), or ``None`` if unreadable."""
    for line in (_read_text(proc_root / "stat") or "").splitlines():
        key, _, value = line.partition(" ")
        if key == "btime" and value.strip().isdigit():
            return float(value)
    return None


def _parse_stat(text: str) -> _Stat | None:
    """Parse ``/proc/<pid>/stat``. ``comm`` may hold spaces and parentheses: split at the last ')'."""
    head, sep, tail = text.rpartition(")")
    open_paren = head.find("(")
    fields = tail.split()
    if not sep or open_paren < 0 or len(fields) < 20:
        return None
    try:
        # Fields 3, 4, 6 and 22 of proc(5): state, ppid, session, starttime.
        return _Stat(
            comm=head[open_paren + 1 :],
            state=fields[0],
            ppid=int(fields[1]),
            session=int(fields[3]),
            start_ticks=int(fields[19]),
        )
    except ValueError:
        return None


def _read_text(path: Path) -> str | None:
    """The file's text, or ``None`` when it is gone or unreadable (races with exit are normal)."""
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None


def _read_argv(path: Path) -> list[str]:
    """The NUL-separated argv, empty arguments kept. Trailing NULs are all dropped: a
    process that set its title (``setproctitle``: Ray workers, gunicorn) pads its argv with
    them, so a final empty argument is indistinguishable from that padding."""
    try:
        with path.open("rb") as file:
            raw = file.read(_MAX_CMDLINE_BYTES)
    except OSError:
        return []
    raw = raw.rstrip(b"\x00")
    if not raw:
        return []
    return [arg.decode("utf-8", errors="replace") for arg in raw.split(b"\x00")]


def _shown(arg: str) -> str:
    """An argument as the command shows it: an empty one as ``''`` (it still counts)."""
    return arg if arg else "''"


def real_uid(status: str) -> int | None:
    """The real uid in the text of ``/proc/<pid>/status`` (``Uid:`` lists the real,
    effective, saved and filesystem uids, the real first); ``None`` when absent."""
    uids = (_status_field(status, "Uid") or "").split()
    return int(uids[0]) if uids and uids[0].isdigit() else None


def process_uid(pid: int, *, proc_root: Path = Path("/proc")) -> int | None:
    """The real uid of process ``pid``; ``None`` when no such process is running, or
    it cannot be read."""
    status = _read_text(proc_root / str(pid) / "status")
    return None if status is None else real_uid(status)


def _status_field(text: str, key: str) -> str | None:
    for line in text.splitlines():
        name, sep, value = line.partition(":")
        if sep and name == key:
            return value.strip()
    return None


def _read_environ(path: Path) -> bytes | None:
    """The NUL-separated initial environment, or ``None``.

    Another user's ``environ`` is readable only with ptrace rights, so an unreadable file is
    normal and simply means "unknown".
    """
    try:
        return path.read_bytes()
    except OSError:
        return None


def _slurm_job_id(environ: bytes | None) -> str | None:
    """``SLURM_JOB_ID`` from the environment, or ``None``."""
    match = _SLURM_JOB_ID.search(environ) if environ is not None else None
    return match.group(1).decode("ascii") if match else None


def _supervised(identity: _Identity) -> bool:
    """Started in a session of its own by a launcher that must outlive it (module docstring)."""
    return identity.jupyter_kernel or identity.elastic_worker


def _namespace_inode(link: str) -> int | None:
    """``"pid:[4026531836]"`` -> ``4026531836``."""
    match = re.fullmatch(r"\w+:\[(\d+)\]", link)
    return int(match.group(1)) if match else None


def _short(text: str, limit: int = MAX_NAME_CHARS) -> str:
    """``text`` within a snapshot string's bound: no NUL, at most ``limit`` characters
    (ShortStr's MAX_NAME_CHARS; the cgroup path's LongStr, MAX_PATH_CHARS)."""
    return text.replace("\x00", "\ufffd")[:limit]


def _optional_short(text: str | None, limit: int = MAX_NAME_CHARS) -> str | None:
    return None if text is None else _short(text, limit)


def _process_owner(
    cgroup: CgroupOwner, user: str | None, uid: int | None, env_job_id: str | None
) -> ProcessOwner:
    # Each string is bounded here, where the owner is built (module docstring, "Bounds"):
    # the parser bounds what it matches too, but one miss must not cost the poll.
    return ProcessOwner(
        user=_optional_short(user),
        uid=uid,
        container_runtime=cgroup.container_runtime,
        container_id=_optional_short(cgroup.container_id),
        pod_uid=_optional_short(cgroup.pod_uid),
        pod_qos=_optional_short(cgroup.pod_qos),
        # The cgroup is the kernel's word; the environment is inherited and can be stale
        # (a process started inside one allocation that outlives it), so it only fills a gap.
        # It is for attribution only: the process sets its own environment, so the reaper
        # protects a job on the cgroup's word alone (reaper.policy.protection).
        slurm_job_id=_optional_short(cgroup.slurm_job_id or env_job_id),
        systemd_unit=_optional_short(cgroup.systemd_unit),
        cgroup=_optional_short(cgroup.cgroup, MAX_PATH_CHARS),
    )
