"""The gpuwatch exception tree, and the exit code each one maps to.

Library code raises these; only ``gpuwatch.cli`` turns them into a one-line
message on stderr and an exit code. Lower-level errors (pynvml, httpx,
SQLAlchemy, OS errors) are translated where they enter, with ``raise ... from``.

::

    GpuwatchError                      exit 1
    ├── ConfigError                    exit 3  bad settings file, env var, option value or scenario
    │   └── ScenarioError              exit 3  a fake-GPU scenario file is invalid
    ├── NvmlUnavailable                exit 4  no NVIDIA driver / library / GPU to talk to
    ├── RemoteError                    exit 5  the central server or local agent is unreachable
    │   ├── AuthError                  exit 5  the server refused our token
    │   └── NotFound                   exit 8  the server has no silence / receiver of that id
    ├── NotRecognized                  exit 6  input is not something we can interpret
    ├── DatabaseError                  exit 7  the database is unreachable or not migrated
    └── DeliveryFailed                 exit 9  a receiver refused or failed a test notification

Exit code 2 is reserved for command-line usage errors (an unknown option or command,
a missing argument or value, no command), which the CLI framework reports itself. A
value the framework's parser refuses (its type, range or choices) is exit 3, like one
the command's own code refuses: ``gpuwatch.cli._is_bad_value``.
"""

from __future__ import annotations


class GpuwatchError(Exception):
    """Base class. ``str(err)`` is a complete, one-line message for a person."""

    exit_code = 1


class ConfigError(GpuwatchError):
    """A setting, config file or command-line value is invalid."""

    exit_code = 3


class ScenarioError(ConfigError):
    """A fake-GPU scenario file cannot be read or is invalid."""


class NvmlUnavailable(GpuwatchError):
    """NVML cannot be used at all: library missing, driver not loaded, or no GPU."""

    exit_code = 4


class RemoteError(GpuwatchError):
    """A gpuwatch server or agent could not be reached or answered with an error."""

    exit_code = 5


class AuthError(RemoteError):
    """The server refused the agent token (HTTP 401/403)."""


class NotFound(RemoteError):
    """The server has nothing of that id or name (HTTP 404 from a route that names one),
    or its database has nothing to act on (``token revoke`` of a host with no token)."""

    exit_code = 8


class NotRecognized(GpuwatchError):
    """The input is not something gpuwatch can interpret (e.g. not an OOM message)."""

    exit_code = 6


class DatabaseError(GpuwatchError):
    """The database is unreachable, or its schema is not at the expected revision."""

    exit_code = 7


class DeliveryFailed(GpuwatchError):
    """A receiver refused a test notification, or the attempt failed (``alerts test-receiver``)."""

    exit_code = 9


EXIT_CODES: dict[int, str] = {
    0: "success",
    1: "unexpected runtime failure; also output that could not be written (standard output closed or on a full disk; `gpuwatch token create` then keeps no token)",
    2: "command-line usage error: an unknown option or command, a missing argument or option value, no command, options that need one another (`gpuwatch reap` without `--idle` or `--pid`); `gpuwatch explain` with no input at a terminal",
    3: "invalid configuration (a config file key, or a `GPUWATCH_AGENT_*` / `GPUWATCH_SERVER_*` environment variable that names no setting or has a bad value), option or argument value (of a wrong type, out of range or not one of the choices, whether the parser or the command refuses it), scenario file, or database URL gpuwatch cannot use (malformed, an unsupported engine, a driver not installed); `gpuwatch explain`: unreadable or empty input",
    4: "NVML unavailable: no NVIDIA driver, library or GPU (and no --fake-gpus)",
    5: "the gpuwatch server or agent is unreachable, or refused the token",
    6: "input not recognised (e.g. `gpuwatch explain` on text that is not an OOM message)",
    7: "database unreachable or not migrated",
    8: "not found: no silence with that id or receiver with that name on the server, no host of that name on the server (`gpuwatch history --host`), or no active token for that host (`gpuwatch token revoke`)",
    9: "a receiver refused or failed the test notification (`gpuwatch alerts test-receiver`)",
    10: "`gpuwatch fit`: the model does not fit on any of the GPUs asked about",
    11: "`gpuwatch fit`: cannot tell; the answer depends on an input not given (e.g. --config)",
    20: "`gpuwatch reap`: nothing to do, no process qualifies (0: every chosen process was stopped, or a dry run chose some)",
    21: "`gpuwatch reap`: partial, some chosen processes were not stopped (not permitted, identity changed, unkillable, active again)",
    22: "`gpuwatch reap`: refused before any signal (host PIDs not visible, a PID namespace other than the one `proc_root` shows, not confirmed or no answer at the prompt, audit log unwritable or writable by others, history not served by this host's agent or `--agent` naming another host, --pid target not eligible)",
    126: "`gpuwatch fake-nvml exec`: the command was found but cannot be run (as a shell answers)",
    127: "`gpuwatch fake-nvml exec`: the command was not found",
    130: "interrupted (Ctrl-C, SIGINT; for `gpuwatch reap` while stopping, SIGTERM too: the stop in progress is recorded as `interrupted`) before the command finished; `gpuwatch agent` and `gpuwatch demo` are stopped that way and exit 0 once stopped cleanly",
    141: "standard output was closed before everything was written (a reader such as `head -1` went away), as a shell reports SIGPIPE",
}

# Verdicts rather than failures: `gpuwatch fit` prints its report, then exits with these
# so scripts can branch on the answer (0 means it fits).
EXIT_DOES_NOT_FIT = 10
EXIT_CANNOT_TELL = 11
