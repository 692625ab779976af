"""A SQLite database holds every user's command lines and the token hashes: its file,
``-wal`` and ``-shm`` are the owner's alone (0600) whatever the umask, and a file
found readable by others is made so on the first connection."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuwatch.server.database import create_database
from gpuwatch.server.database.migrate import upgrade


@pytest.fixture
def open_umask() -> Iterator[None]:
    previous = os.umask(0o022)
    yield
    os.umask(previous)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_new_database_and_its_wal_and_shm_are_0600(tmp_path: Path, open_umask: None) -> None:
    path = tmp_path / "fleet.db"
    database = create_database(f"sqlite:///{path}")
    try:
        upgrade(database)  # writes: the -wal and -shm exist now
        files = [path, Path(f"{path}-wal"), Path(f"{path}-shm")]
        assert all(f.exists() for f in files)
        assert [_mode(f) for f in files] == [0o600] * 3
    finally:
        database.dispose()


def test_a_world_readable_database_is_made_the_owners_alone(
    tmp_path: Path, open_umask: None
) -> None:
    path = tmp_path / "fleet.db"
    path.touch(mode=0o644)
    os.chmod(path, 0o644)
    database = create_database(f"sqlite:///{path}")
    try:
        upgrade(database)
        assert _mode(path) == 0o600
    finally:
        database.dispose()
