"""A process that runs as root through its effective or saved uid is root's to the
reaper, whatever its real uid (a setuid-root helper: ``Uid: 4242 0 0 0``).

Real processes: one started with only its real uid changed (``setpriv --ruid``), as a
setuid-root binary run by user 4242 is; and one that is 4242's in every uid.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from reaper.test_policy import candidate, one

from gpuwatch.agent.reaper.policy import Protections
from gpuwatch.agent.reaper.procfs import ProcReader
from gpuwatch.agent.reaper.settings import ReapSettings

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to set another uid")

PROTECTIONS = Protections.from_settings(ReapSettings(), self_pids=(), proc_root=Path("/proc"))
USER = 4242


@pytest.fixture
def processes() -> Iterator[dict[str, subprocess.Popen[bytes]]]:
    started = {
        # Real uid 4242; effective and saved stay root's.
        "setuid": subprocess.Popen(["setpriv", f"--ruid={USER}", "--", "sleep", "60"]),
        "plain": subprocess.Popen(
            ["setpriv", f"--reuid={USER}", f"--regid={USER}", "--clear-groups", "--", "sleep", "60"]
        ),
    }
    yield started
    for process in started.values():
        process.kill()
        process.wait(10)


def _uids(pid: int) -> list[str]:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # setpriv execs sleep once its uids are set
        if Path(f"/proc/{pid}/comm").read_text().strip() == "sleep":
            status = Path(f"/proc/{pid}/status").read_text().splitlines()
            return next(line.split()[1:4] for line in status if line.startswith("Uid:"))
        time.sleep(0.01)
    raise AssertionError("setpriv did not exec")


def test_a_process_with_root_as_effective_or_saved_uid_is_protected_as_roots(processes) -> None:
    setuid, plain = processes["setuid"].pid, processes["plain"].pid
    assert _uids(setuid) == [str(USER), "0", "0"] and _uids(plain) == [str(USER)] * 3
    verdict = one(candidate(setuid, uid=USER), protections=PROTECTIONS)
    assert verdict == ("spare", "protected_root")
    assert one(candidate(plain, uid=USER), protections=PROTECTIONS) == ("reap", "idle")


def test_the_identity_check_before_a_signal_needs_every_uid_to_be_the_users(processes) -> None:
    reader = ProcReader(Path("/proc"))
    for name in processes:
        _uids(processes[name].pid)
    setuid, plain = (reader.read(processes[n].pid) for n in ("setuid", "plain"))
    assert setuid is not None and plain is not None
    # The plan saw uid 4242; a process that is root by its effective uid (or exec'd a
    # setuid binary since) is not the process planned on: nothing is sent.
    assert not setuid.matches(start_time=setuid.start_time, uid=USER)
    assert plain.matches(start_time=plain.start_time, uid=USER)
    assert setuid.uids == (USER, 0, 0)
