"""Process identity from ``/proc``: is PID *n* still the process we started?

A PID alone is not an identity (PIDs are reused), so the fake records each stand-in's
start time (``/proc/<pid>/stat`` field 22, clock ticks since boot) and the boot id, and
treats a process as alive only while both match and it is not a zombie: the driver
frees a process's GPU memory when it exits, before its parent reaps it.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")


@dataclass(frozen=True)
class ProcessIdentity:
    """A PID plus its start time; ``start_ticks`` is None for a PID we never saw alive."""

    pid: int
    start_ticks: int | None


def _stat_fields(pid: int) -> list[str] | None:
    """Fields 3.. of ``/proc/<pid>/stat`` (after the parenthesised command), or None."""
    try:
        raw = (PROC / str(pid) / "stat").read_bytes()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return raw[raw.rindex(b")") + 2 :].decode("ascii", "replace").split()


def identify(pid: int) -> ProcessIdentity:
    """The identity of a running PID now; ``start_ticks`` None when it does not exist."""
    fields = _stat_fields(pid)
    if fields is None or fields[0] == "Z":
        return ProcessIdentity(pid, None)
    return ProcessIdentity(pid, int(fields[19]))


def is_alive(identity: ProcessIdentity) -> bool:
    """True while the PID runs, is not a zombie, and started when ``identity`` says."""
    if identity.start_ticks is None:
        return False
    fields = _stat_fields(identity.pid)
    return (
        fields is not None
        and fields[0] not in ("Z", "X")
        and int(fields[19]) == identity.start_ticks
    )


def parent_pid(pid: int) -> int | None:
    """The PPID of a running process, or None when it is gone."""
    fields = _stat_fields(pid)
    return None if fields is None else int(fields[1])


def boot_id() -> str:
    """This boot's random id; state from an earlier boot must never be trusted."""
    try:
        return (PROC / "sys" / "kernel" / "random" / "boot_id").read_text().strip()
    except OSError:
        return "unknown"


def terminate(identities: list[ProcessIdentity], *, grace_seconds: float = 2.0) -> list[int]:
    """SIGTERM each process that is still the one recorded, wait up to ``grace_seconds``,
    then SIGKILL what is left. Returns the PIDs signalled. Never signals a reused PID:
    a pidfd is opened first, then the identity re-checked, then the signal sent on the fd.
    """
    handles: list[tuple[ProcessIdentity, int]] = []
    try:
        for identity in identities:
            if identity.start_ticks is None:  # never seen alive (or "no supervisor")
                continue
            fd = _open_pidfd(identity.pid)
            if fd is not None and is_alive(identity) and _signal(fd, signal.SIGTERM):
                handles.append((identity, fd))
            elif fd is not None:
                os.close(fd)
        deadline = time.monotonic() + grace_seconds
        # Not our children (the supervisor or init reaps them), so poll rather than wait().
        while any(is_alive(i) for i, _ in handles) and time.monotonic() < deadline:
            time.sleep(0.02)
        for identity, fd in handles:
            if is_alive(identity):
                _signal(fd, signal.SIGKILL)
    finally:
        for _, fd in handles:
            os.close(fd)
    return [identity.pid for identity, _ in handles]


def _open_pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except (ProcessLookupError, PermissionError):
        return None


def _signal(pidfd: int, signum: int) -> bool:
    try:
        signal.pidfd_send_signal(pidfd, signum)
    except (ProcessLookupError, PermissionError):
        return False
    return True
