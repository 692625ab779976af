"""Stop one process safely: pidfd, identity re-check, SIGTERM, bounded wait, SIGKILL.

The sequence for each target (docs/reaper.md, "How a process is stopped"):

1. Read ``/proc/<pid>``: gone or a zombie -> ``already_exited``; another start time
   or uid -> ``identity_changed``.
2. ``pidfd_open(pid)``: from here on the descriptor names *that* process; if it exits
   and the PID is reused, signals through the descriptor fail with ESRCH instead of
   reaching the newcomer. The numeric PID is never signalled. ``pidfd_open`` takes
   the number in *this* process's PID namespace, while every check reads
   ``proc_root`` (a host ``/proc`` bind mount, say): the descriptor must be shown to
   name the PID the checks read, or nothing is sent (:class:`PidfdUnproven`). Before
   the first stop, this process's ``NSpid`` in ``<proc_root>/self/status`` must have
   one entry (it runs in the namespace ``proc_root`` shows; :func:`namespace_problem`);
   and each descriptor's ``Pid:`` in ``<proc_root>/self/fdinfo/<fd>`` (the PID as
   ``proc_root`` numbers it) must be the target's.
3. Read ``/proc/<pid>`` again: the PID may have been reused between steps 1 and 2,
   and the descriptor would then name the newcomer. Same checks as step 1.
4. ``recheck()``: the caller confirms the process is still eligible (still listed by
   NVML, still idle, still unprotected); a reason -> ``no_longer_eligible``.
5. ``before_signal(SIGTERM)`` (the audit row, fsynced), then SIGTERM through the
   descriptor; wait up to ``grace_seconds`` for it to exit (the descriptor becomes
   readable) -> ``terminated``.
6. ``before_signal(SIGKILL)``, SIGKILL, wait up to ``unkillable_seconds`` -> ``killed``,
   or ``unkillable`` (uninterruptible sleep in the driver, D state).

EPERM on a signal -> ``not_permitted`` (no retry); ESRCH -> ``already_exited``. The
clock, the wait and the two system calls are passed in, so tests can count signals
and run the timeline without sleeping.
"""

from __future__ import annotations

import logging
import math
import os
import select
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from gpuwatch.agent.reaper.errors import PidfdUnproven
from gpuwatch.agent.reaper.procfs import ProcReader

log = logging.getLogger(__name__)

Outcome = Literal[
    "terminated",
    "killed",
    "already_exited",
    "not_permitted",
    "identity_changed",
    "unkillable",
    "no_longer_eligible",
    "failed",
]
# Outcomes after which the process is gone and its memory should be free.
GONE: frozenset[str] = frozenset({"terminated", "killed", "already_exited"})


@dataclass(frozen=True)
class Target:
    """The process a decision was about: ``start_time`` epoch seconds, ``uid`` real uid."""

    pid: int
    start_time: float
    uid: int


@dataclass
class KillReport:
    """What happened. ``signals`` lists the signals actually delivered, in order;
    ``seconds`` is from the first signal to the exit seen (``None``: no exit seen)."""

    outcome: Outcome
    detail: str
    signals: list[str] = field(default_factory=list)
    seconds: float | None = None


def wait_readable(fd: int, timeout_seconds: float) -> bool:
    """Wait until the pidfd ``fd`` is readable (its process exited); False on timeout."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    deadline = time.monotonic() + timeout_seconds
    while True:
        remaining = deadline - time.monotonic()
        # poll() retries on EINTR itself (PEP 475); the loop only re-arms the timeout.
        if poller.poll(max(0, math.ceil(remaining * 1000))):
            return True
        if remaining <= 0:
            return False


def namespace_problem(proc_root: Path, *, own_pid: Callable[[], int] = os.getpid) -> str | None:
    """Why a PID opened by this process may name another process than the same PID in
    ``proc_root`` (``None``: they agree).

    ``<proc_root>/self`` is this process as ``proc_root``'s namespace numbers it, and
    its ``NSpid`` lists its PID in that namespace and in each one below it down to its
    own: one entry means it runs in that very namespace. A nested namespace reading the
    host's procfs (``unshare -p`` without ``--mount-proc``, a container with the host's
    /proc bind-mounted and no host PIDs) has more; a procfs of a namespace it is not in
    has no ``self``. Without ``NSpid`` (kernels before 4.1), its PID must read the same
    both ways.
    """
    where = proc_root / "self"
    try:
        shown = os.readlink(where)
        status = (where / "status").read_text(encoding="ascii", errors="replace")
    except OSError:
        return (
            f"{proc_root} is not the procfs of this process's PID namespace or an "
            "ancestor's (it has no 'self'): the PIDs it shows cannot be opened from here; "
            "nothing is signalled"
        )
    nspid = next(
        (line.split()[1:] for line in status.splitlines() if line.startswith("NSpid:")), None
    )
    nested = len(nspid) > 1 if nspid is not None else shown != str(own_pid())
    if nested:
        return (
            f"this gpuwatch runs in a nested PID namespace but reads {proc_root}, which "
            "shows another namespace's PIDs (the host's): a PID opened here would name a "
            "different process, or none. Nothing is signalled; run it in the host's PID "
            "namespace (--pid=host / hostPID), or with the namespace's own /proc"
        )
    return None


def fdinfo_pid(proc_root: Path) -> Callable[[int], int | None]:
    """A reader of the ``Pid:`` a pidfd's fdinfo shows: the PID of the process it
    names, numbered in ``proc_root``'s namespace (-1: it exited; 0: not in that
    namespace). ``None`` when the kernel shows no ``Pid:`` (before 5.5)."""

    def read(fd: int) -> int | None:
        try:
            text = (proc_root / "self" / "fdinfo" / str(fd)).read_text(encoding="ascii")
        except (OSError, UnicodeDecodeError):
            return None
        for line in text.splitlines():
            if line.startswith("Pid:"):
                try:
                    return int(line.split()[1])
                except (IndexError, ValueError):
                    return None
        return None

    return read


class Killer:
    """Stops processes through pidfds; everything that touches the outside is injected.

    ``wait_exit(fd, seconds) -> bool`` waits for the process behind ``fd`` to exit;
    ``clock`` (monotonic seconds) times it. ``open_pidfd`` and ``send_signal`` default
    to :func:`os.pidfd_open` and :func:`signal.pidfd_send_signal`; ``pidfd_pid`` to
    :func:`fdinfo_pid` and ``namespace_check`` to :func:`namespace_problem`, both over
    the reader's ``proc_root``.
    """

    def __init__(
        self,
        procs: ProcReader,
        *,
        grace_seconds: float,
        unkillable_seconds: float,
        clock: Callable[[], float] = time.monotonic,
        wait_exit: Callable[[int, float], bool] = wait_readable,
        open_pidfd: Callable[[int], int] = os.pidfd_open,
        send_signal: Callable[[int, int], None] = signal.pidfd_send_signal,
        close: Callable[[int], None] = os.close,
        pidfd_pid: Callable[[int], int | None] | None = None,
        namespace_check: Callable[[], str | None] | None = None,
    ) -> None:
        self._procs = procs
        self._pidfd_pid = pidfd_pid or fdinfo_pid(procs.root)
        self._namespace_check = namespace_check or (lambda: namespace_problem(procs.root))
        self._namespace: tuple[str | None] | None = None  # the check's answer, once
        self.grace_seconds = grace_seconds
        self.unkillable_seconds = unkillable_seconds
        self._clock = clock
        self._wait = wait_exit
        self._open = open_pidfd
        self._send = send_signal
        self._close = close

    def stop(
        self,
        target: Target,
        *,
        recheck: Callable[[], str | None],
        before_signal: Callable[[signal.Signals], None],
    ) -> KillReport:
        """Stop ``target`` (see the module docstring). ``before_signal`` may raise to
        abort (an audit log that cannot be written): nothing is sent then. Raises
        :class:`PidfdUnproven`, having sent nothing, when the descriptor cannot be
        shown to name the PID the checks read."""
        problem = self.signal_problem()
        if problem is not None:
            raise PidfdUnproven(problem)
        changed = self._check(target)
        if changed is not None:
            return changed
        try:
            fd = self._open(target.pid)
        except ProcessLookupError:
            return KillReport(
                "already_exited", "it exited by itself before any signal; nothing was sent"
            )
        except OSError as err:
            return KillReport("failed", f"pidfd_open failed: {os.strerror(err.errno or 0)}")
        try:
            shown = self._pidfd_pid(fd)
            if shown == -1:
                return KillReport(
                    "already_exited", "it exited by itself before any signal; nothing was sent"
                )
            if shown is not None and shown != target.pid:
                # Not a reuse race (the PID a pidfd names never changes): the number was
                # taken in another namespace than the one the checks read.
                raise PidfdUnproven(
                    f"pidfd_open({target.pid}) opened the process {self._procs.root} shows "
                    f"as PID {shown or 'none'}, not {target.pid}: this gpuwatch's PID "
                    f"namespace is not the one {self._procs.root} shows; nothing was signalled"
                )
            # The PID may have been reused between the first check and pidfd_open.
            changed = self._check(target)
            if changed is not None:
                return changed
            why = recheck()
            if why is not None:
                return KillReport("no_longer_eligible", why)
            return self._signal_and_wait(fd, target, before_signal)
        finally:
            self._close(fd)

    def signal_problem(self) -> str | None:
        """Why no process can be signalled safely from here (``None``: they can); the
        namespaces of a process do not change, so this is asked once."""
        if self._namespace is None:
            self._namespace = (self._namespace_check(),)
        return self._namespace[0]

    def gone(self, target: Target) -> bool:
        """Whether ``target`` is no longer running (exited, a zombie, or its PID now
        names another process): for the record of a stop that was cut short."""
        return self._check(target) is not None

    def _check(self, target: Target) -> KillReport | None:
        state = self._procs.read(target.pid)
        if state is None or state.exited:
            return KillReport(
                "already_exited", "it exited by itself before any signal; nothing was sent"
            )
        if not state.matches(start_time=target.start_time, uid=target.uid):
            return KillReport(
                "identity_changed",
                f"PID {target.pid} now belongs to another process "
                f"(started {state.start_time}, uid {state.uid}); nothing sent",
            )
        return None

    def _signal_and_wait(
        self, fd: int, target: Target, before_signal: Callable[[signal.Signals], None]
    ) -> KillReport:
        report = KillReport("failed", "")
        started = self._clock()
        steps: tuple[tuple[signal.Signals, float, Outcome], ...] = (
            (signal.SIGTERM, self.grace_seconds, "terminated"),
            (signal.SIGKILL, self.unkillable_seconds, "killed"),
        )
        for sig, timeout, outcome in steps:
            before_signal(sig)  # may raise: then nothing is sent
            problem = self._deliver(fd, sig, target.pid)
            if problem is not None:
                report.outcome, report.detail = problem
                if report.outcome == "already_exited" and report.signals:
                    # It exited between SIGTERM and SIGKILL: SIGTERM did it.
                    report.outcome = "terminated"
                    report.seconds = self._clock() - started
                return report
            report.signals.append(sig.name)
            if self._wait(fd, timeout):
                report.outcome = outcome
                report.seconds = self._clock() - started
                report.detail = (
                    f"exited {report.seconds:.1f}s after SIGTERM"
                    if sig == signal.SIGTERM
                    else f"killed by SIGKILL {report.seconds:.1f}s after SIGTERM (it ignored SIGTERM)"
                )
                return report
            log.warning("pid %s still running %.1fs after %s", target.pid, timeout, sig.name)
        report.outcome = "unkillable"
        report.detail = (
            f"still there {self.unkillable_seconds:.0f}s after SIGKILL "
            "(uninterruptible sleep in the driver?)"
        )
        return report

    def _deliver(self, fd: int, sig: signal.Signals, pid: int) -> tuple[Outcome, str] | None:
        """Send ``sig`` through ``fd``; ``None`` when delivered, else (outcome, detail)."""
        try:
            self._send(fd, sig)
        except ProcessLookupError:
            return "already_exited", f"it exited by itself before {sig.name}; nothing was sent"
        except PermissionError:
            return (
                "not_permitted",
                f"{sig.name} not permitted (another user's process: needs root or CAP_KILL)",
            )
        except OSError as err:
            return "failed", f"{sig.name} failed: {os.strerror(err.errno or 0)}"
        log.info("sent %s to pid %s through its pidfd", sig.name, pid)
        return None
