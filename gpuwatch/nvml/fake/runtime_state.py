"""The runtime state every process on the host shares for one booted scenario.

One JSON file per scenario content, ``<runtime dir>/<name>-<hash16>.json``, records the
scenario epoch (wall-clock start) and the identity of each stand-in, so the agent,
``gpuwatch status`` and unmodified third-party tools all see the same GPUs and PIDs.
A sibling ``.lock`` file (``flock``) makes "boot if not booted" atomic across processes.

The runtime dir is ``$XDG_RUNTIME_DIR/gpuwatch-fake`` (per-user tmpfs, emptied at logout
and reboot), else ``/tmp/gpuwatch-fake-<uid>``; it is created mode 0700 and must be
owned by the current user, because the files in it name PIDs that ``stop`` signals.
"""

from __future__ import annotations

import fcntl
import json
import os
import stat
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from gpuwatch.errors import ConfigError
from gpuwatch.nvml.fake.procfs import ProcessIdentity

STATE_FORMAT = 1


@dataclass(frozen=True)
class RuntimeState:
    """One boot of a scenario. Times are Unix epoch seconds (wall clock)."""

    scenario: str
    content_hash: str
    boot_id: str
    epoch: float
    deadline: float  # stand-ins and the supervisor exit by then
    supervisor: ProcessIdentity
    # ProcessSpec.key -> identity, for spawned stand-ins and attached PIDs.
    processes: dict[str, ProcessIdentity] = field(default_factory=dict)
    # The keys above that are stand-ins we started (the only ones `stop` may signal).
    standins: tuple[str, ...] = ()

    def standin_identities(self) -> list[ProcessIdentity]:
        return [self.processes[key] for key in self.standins if key in self.processes]

    def to_json(self) -> str:
        return json.dumps(
            {
                "format": STATE_FORMAT,
                "scenario": self.scenario,
                "content_hash": self.content_hash,
                "boot_id": self.boot_id,
                "epoch": self.epoch,
                "deadline": self.deadline,
                "supervisor": [self.supervisor.pid, self.supervisor.start_ticks],
                "processes": {k: [v.pid, v.start_ticks] for k, v in self.processes.items()},
                "standins": list(self.standins),
            },
            indent=1,
        )

    @classmethod
    def from_json(cls, text: str) -> RuntimeState:
        """Raises ValueError (or KeyError/TypeError) for a file in another format."""
        data = json.loads(text)
        if data.get("format") != STATE_FORMAT:
            raise ValueError(f"state format {data.get('format')!r}")
        return cls(
            scenario=str(data["scenario"]),
            content_hash=str(data["content_hash"]),
            boot_id=str(data["boot_id"]),
            epoch=float(data["epoch"]),
            deadline=float(data["deadline"]),
            supervisor=ProcessIdentity(*data["supervisor"]),
            processes={k: ProcessIdentity(*v) for k, v in data["processes"].items()},
            standins=tuple(str(k) for k in data["standins"]),
        )


def default_runtime_dir(environ: os._Environ[str] | dict[str, str] | None = None) -> Path:
    """``$XDG_RUNTIME_DIR/gpuwatch-fake`` or ``/tmp/gpuwatch-fake-<uid>``.

    This reads the environment directly (not gpuwatch.settings) because the fake runs
    inside third-party programs through ``sitecustomize``, where only the stdlib is safe
    to import; XDG_RUNTIME_DIR is the standard per-user location, not gpuwatch config.
    """
    env = os.environ if environ is None else environ
    base = env.get("XDG_RUNTIME_DIR")
    if base and os.path.isabs(base):
        return Path(base) / "gpuwatch-fake"
    return Path(tempfile.gettempdir()) / f"gpuwatch-fake-{os.geteuid()}"


def prepare_runtime_dir(path: str | os.PathLike[str] | None) -> Path:
    """Create the runtime dir (0700) if needed and check that we own it.

    Raises ConfigError when it cannot be created or belongs to someone else.
    """
    directory = Path(path) if path is not None else default_runtime_dir()
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = directory.lstat()
    except OSError as err:
        raise ConfigError(f"cannot create the fake-GPU runtime dir {directory}: {err}") from err
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid():
        raise ConfigError(
            f"fake-GPU runtime dir {directory} is not a directory owned by uid {os.geteuid()}"
        )
    return directory


def state_path(runtime_dir: Path, scenario_name: str, content_hash: str) -> Path:
    """Where the state of this scenario content lives; its lock is the ``.lock`` sibling."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in scenario_name)[:64]
    return runtime_dir / f"{safe}-{content_hash[:16]}.json"


@contextmanager
def locked(state_file: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on the state's lock file (blocks until free).

    The lock file is removed with its state (:func:`remove_lock`, under the lock), so a
    process that waited on it may hold a lock on a file no longer at that path while a
    newcomer locks a fresh one there: after locking, the file must still be the one
    the path names, or the lock is taken again.
    """
    lock_file = state_file.with_suffix(".lock")
    while True:
        fd = os.open(lock_file, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            held = os.fstat(fd)
            try:
                named = os.stat(lock_file)
            except FileNotFoundError:
                named = None
            if named is not None and (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino):
                break
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)  # removed while we waited: lock the file now there
    try:
        yield
    finally:
        os.close(fd)  # closing releases the lock


def remove_lock(state_file: Path) -> None:
    """Delete the state's lock file; only while holding it (see :func:`locked`)."""
    state_file.with_suffix(".lock").unlink(missing_ok=True)


def read_state(state_file: Path) -> RuntimeState | None:
    """The recorded state, or None when there is none or it is unreadable."""
    try:
        return RuntimeState.from_json(state_file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError):
        # A torn or foreign file is treated as absent; the caller reboots the scenario.
        return None


def write_state(state_file: Path, state: RuntimeState) -> None:
    """Replace the state file atomically, so readers see the old or the new, never half."""
    tmp = state_file.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(state.to_json(), encoding="utf-8")
    os.replace(tmp, state_file)


def remove_state(state_file: Path) -> None:
    """Delete the state file (stand-ins notice within a second and exit)."""
    state_file.unlink(missing_ok=True)
