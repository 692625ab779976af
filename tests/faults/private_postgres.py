"""A private Postgres cluster a test may restart and crash: its own data directory and port.

The shared cluster at 127.0.0.1:5432 serves every session and must never be restarted;
this one is made with ``initdb`` in a temp directory, listens on a free loopback port
(TCP only: no Unix socket), and runs with ``fsync = off`` (it is thrown away; a
crash of Postgres, unlike a power cut, loses nothing already handed to the OS). ``initdb`` and
``postgres`` refuse to run as root, so as root they run as an unprivileged user:
``postgres`` where the server package created it, else ``nobody`` (on every Debian).

Binaries: ``initdb`` on PATH, else ``pg_config --bindir``, else Debian's
``/usr/lib/postgresql/<version>/bin``. Without them the test skips on a laptop and
fails under ``CI=true``, as every other Postgres test does.
"""

from __future__ import annotations

import os
import pwd
import re
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

SUPERUSER = "postgres"
# Conservative: a restart must never be waited on for ever, yet a loaded 2-core CI
# machine may need a few seconds for crash recovery.
PG_CTL_TIMEOUT_SECONDS = 60


def find_bindir() -> Path | None:
    """The directory holding ``initdb``, ``pg_ctl`` and ``postgres``, or None."""
    candidates: list[Path] = []
    if found := shutil.which("initdb"):
        candidates.append(Path(found).resolve().parent)
    if pg_config := shutil.which("pg_config"):
        result = subprocess.run(
            [pg_config, "--bindir"], capture_output=True, text=True, check=False, timeout=30
        )
        if result.returncode == 0 and result.stdout.strip():
            candidates.append(Path(result.stdout.strip()))

    def version(path: Path) -> int:
        match = re.search(r"/(\d+)/bin$", str(path))
        return int(match.group(1)) if match else 0

    candidates += sorted(Path("/usr/lib/postgresql").glob("*/bin"), key=version, reverse=True)
    for bindir in candidates:
        if all((bindir / name).is_file() for name in ("initdb", "pg_ctl", "postgres")):
            return bindir
    return None


def require_bindir() -> Path:
    bindir = find_bindir()
    if bindir is None:
        reason = "no Postgres server binaries (initdb, pg_ctl, postgres) on this machine"
        if os.environ.get("CI") == "true":
            pytest.fail(f"{reason}; they are required under CI=true")
        pytest.skip(reason)
    return bindir


def _unprivileged_user() -> pwd.struct_passwd | None:
    """Who runs the cluster: None (this process's user) unless this process is root."""
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "nobody"):
        try:
            return pwd.getpwnam(name)
        except KeyError:
            continue
    raise RuntimeError("running as root and neither user 'postgres' nor 'nobody' exists")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class PrivateCluster:
    """One initdb'd cluster: :meth:`start`, :meth:`stop`, :meth:`restart` with a
    shutdown ``mode`` (``smart``, ``fast``: sessions terminated; ``immediate``: a crash,
    recovered from the WAL on the next start)."""

    def __init__(self, bindir: Path, root: Path) -> None:
        self.bindir = bindir
        self.root = root
        self.data = root / "data"
        self.log = root / "postgres.log"
        self.port = 0
        self._user = _unprivileged_user()

    def url(self, database: str = "postgres") -> str:
        return f"postgresql+psycopg://{SUPERUSER}@127.0.0.1:{self.port}/{database}"

    def _run(self, *args: str) -> subprocess.CompletedProcess[str]:
        command = list(args)
        if self._user is not None:
            # setpriv (util-linux, essential on Debian) rather than su/runuser: no PAM,
            # no login shell, works for a user whose shell is nologin.
            command = [
                "setpriv",
                f"--reuid={self._user.pw_uid}",
                f"--regid={self._user.pw_gid}",
                "--clear-groups",
                "--",
                *command,
            ]
        return subprocess.run(
            command,
            cwd=self.root,  # the user may not be able to enter the caller's directory
            capture_output=True,
            text=True,
            check=False,
            timeout=PG_CTL_TIMEOUT_SECONDS + 30,
        )

    def _checked(self, *args: str) -> None:
        result = self._run(*args)
        if result.returncode != 0:
            tail = self.log.read_text()[-2000:] if self.log.exists() else ""
            raise RuntimeError(
                f"{' '.join(args[:2])} failed ({result.returncode}):"
                f" {result.stdout}{result.stderr}\n{tail}"
            )

    def init(self) -> None:
        if self._user is not None:
            os.chown(self.root, self._user.pw_uid, self._user.pw_gid)
        self.root.chmod(0o700)
        self._checked(
            str(self.bindir / "initdb"),
            "-D", str(self.data),
            "-U", SUPERUSER,
            "--auth=trust",
            "--encoding=UTF8",
            "--locale=C",
            "--no-sync",
        )  # fmt: skip

    def _configure(self, port: int) -> None:
        # postgresql.auto.conf is read last: these win over initdb's postgresql.conf,
        # and every start and restart uses them (no -o options to repeat).
        (self.data / "postgresql.auto.conf").write_text(
            "listen_addresses = '127.0.0.1'\n"
            f"port = {port}\n"
            "unix_socket_directories = ''\n"
            # fsync off: commits still reach the OS before they are acknowledged, so
            # a crash of Postgres (-m immediate) loses none; only a power cut would.
            # (synchronous_commit must stay on: with it off, an immediate shutdown
            # loses commits already acknowledged, and the test would see them lost.)
            "fsync = off\n"
            "max_connections = 40\n"
            "shared_buffers = 32MB\n"
        )

    def start(self) -> None:
        """Start, on the port already chosen, or on a free one the first time (a port
        taken between choosing and listening is retried with another)."""
        for _ in range(3):
            if not self.port:
                self._configure(port := _free_port())
            else:
                port = self.port
            result = self._pg_ctl("start", "-l", str(self.log))
            if result.returncode == 0:
                self.port = port
                return
            if self.port:
                break  # the cluster's own port: no other to try
        raise RuntimeError(f"pg_ctl start failed: {result.stdout}{result.stderr}")

    def ensure_started(self) -> None:
        """Start it if a test left it stopped (``pg_ctl status`` exits 3 then)."""
        if self._pg_ctl("status").returncode != 0:
            self.start()

    def stop(self, mode: str = "fast") -> None:
        self._checked(*self._pg_ctl_args("stop", "-m", mode))

    def restart(self, mode: str = "fast") -> None:
        self._checked(*self._pg_ctl_args("restart", "-m", mode, "-l", str(self.log)))

    def _pg_ctl_args(self, *args: str) -> list[str]:
        return [
            str(self.bindir / "pg_ctl"),
            "-D", str(self.data),
            "-w", "-t", str(PG_CTL_TIMEOUT_SECONDS),
            *args,
        ]  # fmt: skip

    def _pg_ctl(self, *args: str) -> subprocess.CompletedProcess[str]:
        return self._run(*self._pg_ctl_args(*args))


@contextmanager
def private_cluster() -> Iterator[PrivateCluster]:
    """A started private cluster, stopped (immediately) and deleted afterwards."""
    bindir = require_bindir()
    # Not under pytest's tmp_path: its parents are 0700 root's, where the cluster's
    # user could not reach its own data directory.
    root = Path(tempfile.mkdtemp(prefix="gpuwatch-pg-"))
    cluster = PrivateCluster(bindir, root)
    try:
        cluster.init()
        cluster.start()
        yield cluster
    finally:
        if (cluster.data / "postmaster.pid").exists():
            cluster._pg_ctl("stop", "-m", "immediate")
        shutil.rmtree(root, ignore_errors=True)
