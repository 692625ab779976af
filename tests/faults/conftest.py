"""Fixtures for the fault tests: a fresh Postgres schema, and root-only tmpfs mounts.

Postgres is the shared cluster at 127.0.0.1:5432; it is never restarted here. A test
that needs "Postgres restarted" cuts the server's own connections instead (a proxy it
stops, or ``pg_terminate_backend`` on the sessions named by its ``application_name``).
"""

from __future__ import annotations

import os
import subprocess
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest
from server.conftest import POSTGRES_URL, _postgres_available
from sqlalchemy import create_engine, text

from faults.central import PostgresSchema


@pytest.fixture
def postgres_schema() -> Iterator[PostgresSchema]:
    _postgres_available()
    name = f"gwfault_{uuid.uuid4().hex[:12]}"
    admin = create_engine(POSTGRES_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE SCHEMA "{name}"'))
    try:
        yield PostgresSchema(schema=name, application_name=name)
    finally:
        with admin.connect() as conn:
            conn.execute(
                text(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                    " WHERE application_name = :name"
                ),
                {"name": name},
            )
            conn.execute(text(f'DROP SCHEMA "{name}" CASCADE'))
        admin.dispose()


def _can_mount() -> bool:
    return os.geteuid() == 0


@contextmanager
def _tmpfs(directory: Path, size: str) -> Iterator[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(directory)],
        check=True,
        capture_output=True,
    )
    try:
        yield directory
    finally:
        subprocess.run(["umount", "-l", str(directory)], check=False, capture_output=True)


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Callable[[str, str], Path]]:
    """``small_disk(name, size)``: a fresh tmpfs of ``size`` (e.g. ``"2m"``) mounted at
    ``tmp_path/name``, unmounted afterwards. Needs root; outside CI the test skips
    without it, under ``CI=true`` it fails, so CI cannot go green by skipping."""
    if not _can_mount():
        if os.environ.get("CI") == "true":
            pytest.fail("disk-full tests need root (to mount a tmpfs) under CI=true")
        pytest.skip("disk-full tests need root to mount a small tmpfs")
    with ExitStack() as mounts:
        yield lambda name, size: mounts.enter_context(_tmpfs(tmp_path / name, size))
