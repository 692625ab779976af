"""The killer on real processes: pidfd, identity re-check, SIGTERM, grace, SIGKILL."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from reaper.helpers import Signals
from reaper.rig import ALICE, BOB, REPO_ROOT

from gpuwatch.agent.reaper.killer import Killer, Target
from gpuwatch.agent.reaper.procfs import ProcReader


def _target(pid: int) -> Target:
    state = ProcReader().read(pid)
    assert state is not None and state.start_time is not None and state.uid is not None
    return Target(pid, state.start_time, state.uid)


class Timed(Signals):
    """Records when each signal was delivered (monotonic seconds)."""

    def __init__(self) -> None:
        super().__init__()
        self.at: list[float] = []

    def __call__(self, fd: int, sig: int) -> None:
        super().__call__(fd, sig)
        self.at.append(time.monotonic())


def _killer(send: Callable[[int, int], None], *, grace: float = 5.0) -> Killer:
    return Killer(ProcReader(), grace_seconds=grace, unkillable_seconds=5.0, send_signal=send)


def _audit(rows: list[str]) -> Callable[[signal.Signals], None]:
    return lambda sig: rows.append(sig.name)


def test_sigterm_honoured_sends_no_sigkill(victims) -> None:
    victim = victims()
    signals, rows = Signals(), list[str]()
    report = _killer(signals).stop(
        _target(victim.pid), recheck=lambda: None, before_signal=_audit(rows)
    )
    assert report.outcome == "terminated"
    assert signals.names == rows == ["SIGTERM"]
    assert victim.exit_signal() == signal.SIGTERM


def test_sigterm_ignored_gets_sigkill_at_the_grace_deadline(victims) -> None:
    victim = victims(stubborn=True)
    signals, rows = Timed(), list[str]()
    report = _killer(signals, grace=1.0).stop(
        _target(victim.pid), recheck=lambda: None, before_signal=_audit(rows)
    )
    assert report.outcome == "killed"
    assert signals.names == rows == ["SIGTERM", "SIGKILL"]
    waited = signals.at[1] - signals.at[0]
    assert 1.0 <= waited < 2.0, waited  # the deadline, plus scheduling on a busy machine
    assert victim.exit_signal() == signal.SIGKILL


def test_exit_before_the_check_sends_nothing(victims) -> None:
    victim = victims()
    target = _target(victim.pid)
    victim.process.kill()
    victim.process.wait()
    signals = Signals()
    report = _killer(signals).stop(target, recheck=lambda: None, before_signal=_audit([]))
    assert report.outcome == "already_exited"
    assert signals.sent == []


def test_exit_between_the_check_and_the_signal_sends_nothing(victims) -> None:
    victim = victims()
    attempts: list[str] = []

    def send(fd: int, sig: int) -> None:
        attempts.append(signal.Signals(sig).name)
        signal.pidfd_send_signal(fd, sig)  # raises ProcessLookupError: the pidfd is stale

    def exits_now() -> None:
        victim.process.kill()
        victim.process.wait()  # reaped: the pidfd now names a process that is gone

    report = _killer(send).stop(
        _target(victim.pid), recheck=lambda: exits_now(), before_signal=_audit([])
    )
    assert report.outcome == "already_exited"
    assert report.signals == []  # tried through the stale pidfd, delivered nowhere
    assert attempts == ["SIGTERM"]


def test_another_uid_or_start_time_is_identity_changed(victims) -> None:
    victim = victims()
    target = _target(victim.pid)
    signals = Signals()
    for changed in (
        Target(target.pid, target.start_time, target.uid + 1),
        Target(target.pid, target.start_time - 3600, target.uid),
    ):
        report = _killer(signals).stop(changed, recheck=lambda: None, before_signal=_audit([]))
        assert report.outcome == "identity_changed"
    assert signals.sent == [] and victim.alive()


def test_a_recheck_reason_stops_everything(victims) -> None:
    victim = victims()
    signals = Signals()
    report = _killer(signals).stop(
        _target(victim.pid), recheck=lambda: "active again", before_signal=_audit([])
    )
    assert (report.outcome, report.detail) == ("no_longer_eligible", "active again")
    assert signals.sent == [] and victim.alive()


def test_an_audit_failure_before_the_signal_sends_nothing(victims) -> None:
    victim = victims()
    signals = Signals()

    def audit_fails(sig: signal.Signals) -> None:
        raise OSError("disk full")

    with pytest.raises(OSError):
        _killer(signals).stop(_target(victim.pid), recheck=lambda: None, before_signal=audit_fails)
    assert signals.sent == [] and victim.alive()


def test_a_process_that_never_exits_is_unkillable() -> None:
    # D state cannot be made on demand: the seams stand in for a process that
    # ignores even SIGKILL (the clock and the wait are the killer's own inputs).
    sent: list[int] = []
    import os

    killer = Killer(
        ProcReader(),
        grace_seconds=30.0,
        unkillable_seconds=10.0,
        wait_exit=lambda fd, seconds: False,
        send_signal=lambda fd, sig: sent.append(sig),
    )
    report = killer.stop(_target(os.getpid()), recheck=lambda: None, before_signal=_audit([]))
    assert report.outcome == "unkillable"
    assert sent == [signal.SIGTERM, signal.SIGKILL]


_AS_OTHER_USER = """
import json, sys
from gpuwatch.agent.reaper.killer import Killer, Target
from gpuwatch.agent.reaper.procfs import ProcReader
pid, start, uid = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
report = Killer(ProcReader(), grace_seconds=1, unkillable_seconds=1).stop(
    Target(pid, start, uid), recheck=lambda: None, before_signal=lambda sig: None)
print(json.dumps({"outcome": report.outcome, "signals": report.signals}))
"""


def test_a_non_root_killer_is_not_permitted_on_another_users_process(victims) -> None:
    victim = victims(uid=ALICE)
    target = _target(victim.pid)
    done = subprocess.run(
        [
            "setpriv",
            f"--reuid={BOB}",
            f"--regid={BOB}",
            "--clear-groups",
            "--",
            sys.executable,
            "-c",
            _AS_OTHER_USER,
            str(target.pid),
            repr(target.start_time),
            str(target.uid),
        ],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=60,
        check=True,
    )
    assert json.loads(done.stdout) == {"outcome": "not_permitted", "signals": []}
    assert victim.alive()


def test_start_times_agree_with_the_samplers(victims) -> None:
    from gpuwatch.agent.procinfo import ProcInfo

    victim = victims()
    facts = ProcInfo(isolated=False).describe(victim.pid)
    state = ProcReader().read(victim.pid)
    assert state is not None and facts.start_time == state.start_time
    assert state.uid == facts.uid == ALICE
    assert Path(f"/proc/{victim.pid}").exists()
