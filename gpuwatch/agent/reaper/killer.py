"""Stop one process safely: pidfd, identity re-check, SIGTERM, bounded wait, SIGKILL.

The sequence for each target (docs/reaper.md, "How a process is stopped"):

1. Read ``/proc/<pid>``: gone or a zombie -> ``already_exited``; another start time
   or uid -> ``identity_changed``.
2. ``pidfd_open(pid)``: from here on the descriptor names *that* process; if it exits
   and the PID is reused, signals through the descriptor fail with ESRCH instead of
   reaching the newcomer. The numeric PID is never signalled.
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
from typing import Literal

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


class Killer:
    """Stops processes through pidfds; everything that touches the outside is injected.

    ``wait_exit(fd, seconds) -> bool`` waits for the process behind ``fd`` to exit;
    ``clock`` (monotonic seconds) times it. ``open_pidfd`` and ``send_signal`` default
    to :func:`os.pidfd_open` and :func:`signal.pidfd_send_signal`.
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
    ) -> None:
        self._procs = procs
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
        abort (an audit log that cannot be written): nothing is sent then."""
        changed = self._check(target)
        if changed is not None:
            return changed
        try:
            fd = self._open(target.pid)
        except ProcessLookupError:
            return KillReport("already_exited", "exited before it could be opened")
        except OSError as err:
            return KillReport("failed", f"pidfd_open failed: {os.strerror(err.errno or 0)}")
        try:
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

    def gone(self, target: Target) -> bool:
        """Whether ``target`` is no longer running (exited, a zombie, or its PID now
        names another process): for the record of a stop that was cut short."""
        return self._check(target) is not None

    def _check(self, target: Target) -> KillReport | None:
        state = self._procs.read(target.pid)
        if state is None or state.exited:
            return KillReport("already_exited", "no longer running")
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
                report.detail = f"exited {report.seconds:.1f}s after SIGTERM"
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
            return "already_exited", f"exited before {sig.name}"
        except PermissionError:
            return (
                "not_permitted",
                f"{sig.name} not permitted (another user's process: needs root or CAP_KILL)",
            )
        except OSError as err:
            return "failed", f"{sig.name} failed: {os.strerror(err.errno or 0)}"
        log.info("sent %s to pid %s through its pidfd", sig.name, pid)
        return None
