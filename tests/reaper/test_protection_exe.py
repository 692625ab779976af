"""Display servers are recognised by their executable, not by a name anyone can set.

Real processes: the name (comm) of each is "Xorg"; only a root-owned binary named Xorg
in a root-owned directory is a display server (audit finding 9: before, the comm alone
protected any process from the reaper).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from reaper.test_policy import candidate, one

from gpuwatch.agent.reaper.policy import Protections
from gpuwatch.agent.reaper.settings import ReapSettings

# The processes here are the test's own (root's, where it runs as root) and stand for
# uid 4242's: the uids in /proc are left out, so only the executable rule is judged
# (test_setuid_protection.py judges those).
PROTECTIONS = replace(
    Protections.from_settings(ReapSettings(), self_pids=(), proc_root=Path("/proc")), uids=None
)

RENAMED = """
import ctypes, time
ctypes.CDLL(None).prctl(15, b"Xorg", 0, 0, 0)  # PR_SET_NAME
print("ready", flush=True)
time.sleep(60)
"""


@pytest.fixture
def started() -> Iterator[list[subprocess.Popen[bytes]]]:
    processes: list[subprocess.Popen[bytes]] = []
    yield processes
    for p in processes:
        p.kill()
        p.wait(10)


def _comm(pid: int) -> str:
    return Path(f"/proc/{pid}/comm").read_text().strip()


def test_a_process_that_names_itself_xorg_is_not_protected(started) -> None:
    p = subprocess.Popen([sys.executable, "-c", RENAMED], stdout=subprocess.PIPE)
    started.append(p)
    assert p.stdout is not None and p.stdout.readline() == b"ready\n"
    assert _comm(p.pid) == "Xorg"
    # Name-only judgement (no executable lookup: the policy cannot read other users'
    # executables) protected it before; now the name counts for system accounts only.
    name_only = Protections(display_servers=PROTECTIONS.display_servers)
    assert one(candidate(p.pid, name="Xorg"), protections=name_only) == ("reap", "idle")
    assert one(candidate(p.pid, name="Xorg"), protections=PROTECTIONS) == ("reap", "idle")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make a root-owned binary")
def test_a_system_binary_named_xorg_is_protected_a_users_copy_is_not(tmp_path, started) -> None:
    system = tmp_path / "system"
    user = tmp_path / "user"
    for directory in (system, user):
        directory.mkdir(mode=0o755)
        shutil.copy("/bin/sleep", directory / "Xorg")
    os.chown(user / "Xorg", 4242, 4242)
    for directory in (system, user):
        started.append(subprocess.Popen([str(directory / "Xorg"), "60"]))
    time.sleep(0.2)
    real, copy = started
    assert one(candidate(real.pid, name="Xorg"), protections=PROTECTIONS) == (
        "spare",
        "protected_display_server",
    )
    assert one(candidate(copy.pid, name="Xorg"), protections=PROTECTIONS) == ("reap", "idle")
