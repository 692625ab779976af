"""H1: a nested PID namespace reading the host's /proc never signals the wrong process.

``pidfd_open`` takes a PID in the caller's namespace; every check reads ``proc_root``.
``nested_ns_inside.py`` runs in ``unshare --pid --fork`` (the host's /proc still
mounted), where the victim's host PID names an innocent process, and reports back.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from reaper.helpers import Signals
from reaper.rig import REPO_ROOT, Victim

from gpuwatch.agent.reaper.errors import PidfdUnproven
from gpuwatch.agent.reaper.killer import Killer, Target, namespace_problem
from gpuwatch.agent.reaper.procfs import ProcReader

HERE = Path(__file__).resolve().parent


def _target(pid: int) -> Target:
    state = ProcReader().read(pid)
    assert state is not None and state.start_time is not None and state.uid is not None
    return Target(pid, state.start_time, state.uid)


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root and unshare"
)
def test_a_nested_namespace_on_the_hosts_proc_signals_nobody(
    victims: Callable[..., Victim],
) -> None:
    victim = victims()
    target = _target(victim.pid)
    done = subprocess.run(
        ["unshare", "--pid", "--fork", sys.executable, str(HERE / "nested_ns_inside.py"),
         str(target.pid), repr(target.start_time), str(target.uid)],
        capture_output=True, text=True, cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    # The setup bites: with neither check, the innocent process got the SIGTERM.
    assert result["unchecked"]["innocent_alive"] is False, result
    # As shipped: refused before opening anything.
    shipped = result["shipped"]
    assert shipped["outcome"].startswith("refused: this gpuwatch runs in a nested PID namespace")
    assert (shipped["sent"], shipped["innocent_alive"]) == ([], True)
    # The pidfd's own fdinfo names the innocent by its host PID: refused too.
    fdinfo = result["fdinfo_only"]
    assert fdinfo["outcome"].startswith(f"refused: pidfd_open({target.pid}) opened the process")
    assert (fdinfo["sent"], fdinfo["innocent_alive"]) == ([], True)
    assert victim.alive()


def test_a_pidfd_naming_another_pid_is_refused_and_nothing_sent(
    victims: Callable[..., Victim],
) -> None:
    victim = victims()
    signals = Signals()
    killer = Killer(
        ProcReader(),
        grace_seconds=1,
        unkillable_seconds=1,
        send_signal=signals,
        pidfd_pid=lambda fd: victim.pid + 1,
    )
    with pytest.raises(PidfdUnproven, match="this gpuwatch's PID namespace is not the one"):
        killer.stop(_target(victim.pid), recheck=lambda: None, before_signal=lambda sig: None)
    assert signals.sent == [] and victim.alive()


def test_the_pidfd_of_a_process_that_exited_is_already_exited(
    victims: Callable[..., Victim],
) -> None:
    victim = victims()
    signals = Signals()
    killer = Killer(
        ProcReader(), grace_seconds=1, unkillable_seconds=1, send_signal=signals,
        pidfd_pid=lambda fd: -1,
    )  # fmt: skip
    report = killer.stop(_target(victim.pid), recheck=lambda: None, before_signal=lambda s: None)
    assert report.outcome == "already_exited" and signals.sent == []


def test_here_the_pids_agree_and_the_fdinfo_names_the_target(
    victims: Callable[..., Victim],
) -> None:
    assert namespace_problem(Path("/proc")) is None
    victim = victims()
    report = Killer(ProcReader(), grace_seconds=5, unkillable_seconds=1).stop(
        _target(victim.pid), recheck=lambda: None, before_signal=lambda s: None
    )
    assert report.outcome == "terminated"


def test_a_procfs_without_self_or_with_a_nested_nspid_is_a_problem(tmp_path: Path) -> None:
    assert "has no 'self'" in (namespace_problem(tmp_path) or "")
    (tmp_path / "4242").mkdir()
    (tmp_path / "self").symlink_to("4242")
    (tmp_path / "self" / "status").write_text("Name:\tx\nNSpid:\t4242\t17\n")
    assert "nested PID namespace" in (namespace_problem(tmp_path) or "")
    (tmp_path / "self" / "status").write_text("Name:\tx\nNSpid:\t4242\n")
    assert namespace_problem(tmp_path) is None
