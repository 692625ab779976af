"""The reaper's refusal, and the exit codes ``gpuwatch reap`` documents.

::

    GpuwatchError
    └── ReapRefused        exit 22  the reaper will not act (and says why)
        ├── AuditError     exit 22  the audit log cannot be written
        └── PidfdUnproven  exit 22  a pidfd may not name the process that was checked

The codes are listed with every other in :data:`gpuwatch.errors.EXIT_CODES`.
"""

from __future__ import annotations

from gpuwatch.errors import GpuwatchError

EXIT_REAPED = 0  # every chosen process is gone (or a dry run chose some)
EXIT_NOTHING_TO_DO = 20  # no process qualifies
EXIT_PARTIAL = 21  # some chosen processes were not stopped
EXIT_REFUSED = 22  # refused before any signal


class ReapRefused(GpuwatchError):
    """The reaper refuses to act: not safe here, not permitted, or not confirmed."""

    exit_code = EXIT_REFUSED


class AuditError(ReapRefused):
    """The audit log cannot be written; nothing is signalled without it."""

    def __init__(self, message: str, *, reason: str) -> None:
        super().__init__(message)
        self.reason = reason  # what failed, without the consequence


class PidfdUnproven(ReapRefused):
    """The killer cannot prove that its pidfd names the process it checked in
    ``proc_root`` (this process's PID namespace is not the one ``proc_root`` shows):
    nothing is signalled, here or later in the run."""
