"""The reaper's audit log: one JSON object per line, appended and fsynced before acting.

Every decision is written, spared processes, refusals and dry runs included, and a
``signal`` row is written and flushed to disk *before* each signal is sent: if the
row cannot be written, the signal is not sent (:class:`AuditError`). The file is
opened ``O_APPEND`` for each row, so several writers (the agent's policy and a
``gpuwatch reap`` by hand) interleave whole lines, and it is created mode 0600 (by
root in another user's directory: owned by that user, :func:`_open_for_append`). An
existing log that others may write, or that belongs to someone else, is refused.

Row fields (docs/reaper.md, "Audit log"): ``at`` (epoch s), ``run`` (one id per
invocation), ``event`` (``decision``, ``refused``, ``signal``, ``outcome``,
``warning``, ``withdrawn``, and the agent's ``policy_started``), ``actor`` (``uid``, ``user``, ``pid``, ``via``,
``sudo_user``), ``host``, ``dry_run``, and per process ``pid``, ``start_time``,
``uid``, ``user``, ``command``, ``gpus``, ``memory_bytes``, ``idle_seconds``,
``verdict``, ``reason``, ``detail``; ``signal`` rows add ``signal``; ``outcome``
rows add ``outcome``, ``signals``, ``memory_freed`` and ``memory_freed_bytes``.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpuwatch.agent.reaper.errors import AuditError


class AuditLog:
    """Appends rows to ``path``; ``clock`` (epoch seconds) stamps rows without ``at``."""

    def __init__(self, path: Path, *, clock: Callable[[], float] = time.time) -> None:
        self.path = path
        self._clock = clock

    def write(self, row: dict[str, Any]) -> None:
        """Append ``row`` as one line and fsync it. Raises :class:`AuditError`."""
        record = {"at": self._clock(), **row}
        line = (json.dumps(record, separators=(",", ":"), default=str) + "\n").encode()
        try:
            created = not self.path.exists()
            if created:
                self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd = _open_for_append(self.path)
            try:
                view = memoryview(line)
                while view:
                    written = os.write(fd, view)
                    view = view[written:]
                os.fsync(fd)
            finally:
                os.close(fd)
            if created:
                _fsync_dir(self.path.parent)
        except OSError as err:
            reason = f"cannot write the reaper's audit log {self.path}: {err.strerror or err}"
            raise AuditError(
                f"{reason}; nothing was signalled (set [agent.reap] audit_log or pass --audit-log)",
                reason=reason,
            ) from err

    def recent(self, max_bytes: int = 8 * 2**20) -> list[dict[str, Any]]:
        """The rows in the last ``max_bytes`` of the log, oldest first (a line cut by
        that bound, or one that is not JSON, is skipped). ``[]`` when unreadable."""
        try:
            with open(self.path, "rb") as file:
                size = file.seek(0, os.SEEK_END)
                file.seek(max(0, size - max_bytes))
                data = file.read()
        except OSError:
            return []
        lines = data.splitlines()
        if size > max_bytes and lines:
            lines = lines[1:]
        rows = []
        for line in lines:
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict):
                rows.append(row)
        return rows

    def read(self) -> list[dict[str, Any]]:
        """Every row so far, oldest first (for tests and ``tail``-like tools)."""
        try:
            text = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return []
        return [json.loads(line) for line in text.splitlines() if line.strip()]


# Never through a symlink, never a FIFO or device, never a file with a second name: root
# appends to this file, and its directory may belong to the agent's service user (the
# units' StateDirectory), which could otherwise point it at any file root can write and
# have rows carrying other users' command lines appended there (a shell's rc file).
_APPEND_FLAGS = (
    os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NOCTTY
    | os.O_NONBLOCK
)  # fmt: skip


def _open_for_append(path: Path) -> int:
    """A descriptor for appending to ``path``, a regular file with one link that only
    its owner may write, owned by the caller, root or its directory's owner (created
    mode 0600 when absent). Raises OSError, with a reason, for anything else.

    Root creating it in a directory another user owns (the agent's StateDirectory, by
    ``sudo gpuwatch reap``, a dry run included) gives it to that owner: the agent's
    service user appends to the same file, and a root-owned 0600 file there would turn
    its policy off for good. The owner of the directory could replace the file anyway.
    """
    try:
        created = True
        try:
            fd = os.open(path, _APPEND_FLAGS | os.O_EXCL, 0o600)
        except FileExistsError:
            created = False
            fd = os.open(path, _APPEND_FLAGS & ~os.O_CREAT)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise OSError(err.errno, "it is a symbolic link, which is never followed") from err
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:
            what = (
                "has more than one name" if stat.S_ISREG(info.st_mode) else "is not a regular file"
            )
            raise OSError(errno.EPERM, f"it {what}")
        directory = os.stat(path.parent)
        if created and os.geteuid() == 0 and directory.st_uid != 0:
            os.fchown(fd, directory.st_uid, directory.st_gid)
        elif info.st_uid not in (os.geteuid(), 0, directory.st_uid):
            raise OSError(
                errno.EPERM,
                f"it belongs to uid {info.st_uid}, neither this user, root nor its "
                "directory's owner, who could rewrite the record",
            )
        if info.st_mode & 0o022:
            # Anyone could rewrite the record of what was stopped: not appended to.
            raise OSError(
                errno.EPERM,
                f"other users may write it (mode {stat.S_IMODE(info.st_mode):04o}): "
                "anyone could rewrite the record; `chmod go-w` it",
            )
    except OSError:
        os.close(fd)
        raise
    return fd


class DryRunAudit(AuditLog):
    """A dry run's audit log: written when it can be, skipped when it cannot.

    A dry run signals nothing, so an unwritable log loses no record of an action, and
    a user without write access to the shared log (a student on a shared box) can still
    see what a real run would do. The first failure is kept in :attr:`error` for a note.
    """

    error: AuditError | None = None

    def write(self, row: dict[str, Any]) -> None:
        if self.error is not None:
            return
        try:
            super().write(row)
        except AuditError as err:
            self.error = err


def _fsync_dir(directory: Path) -> None:
    # A new file's directory entry is durable only once the directory is synced.
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
