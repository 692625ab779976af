"""Run inside a fresh PID namespace (``unshare --pid --fork --mount-proc``), as its PID 1.

Forces PID reuse with ``/proc/sys/kernel/ns_last_pid`` (this namespace's own counter):
a victim is observed, dies, and an *impostor* is started with the same PID. The killer
is then asked to stop the victim, twice: once when the reuse happened before it
looked, and once when it happens after the pidfd was opened (inside ``recheck``).
Prints one JSON object: the outcomes, the signals delivered, and whether each
impostor is alive and untouched (it records any SIGTERM/SIGINT/SIGHUP it gets).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from gpuwatch.agent.reaper.killer import Killer, Target
from gpuwatch.agent.reaper.procfs import ProcReader

IMPOSTOR = """
import signal, sys, time
log = open(sys.argv[1], "a")
def note(sig, frame):
    log.write(signal.Signals(sig).name + "\\n"); log.flush()
for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1):
    signal.signal(sig, note)
print("ready", flush=True)
time.sleep(600)
"""


def spawn(log: Path, *, pid: int | None = None) -> subprocess.Popen[str]:
    if pid is not None:
        Path("/proc/sys/kernel/ns_last_pid").write_text(str(pid - 1))
    process = subprocess.Popen(
        [sys.executable, "-c", IMPOSTOR, str(log)], stdout=subprocess.PIPE, text=True
    )
    assert process.stdout is not None and process.stdout.readline().strip() == "ready"
    if pid is not None and process.pid != pid:
        raise SystemExit(f"could not force PID reuse: got {process.pid}, wanted {pid}")
    return process


def target(pid: int) -> Target:
    state = ProcReader().read(pid)
    assert state is not None and state.start_time is not None and state.uid is not None
    return Target(pid, state.start_time, state.uid)


def main(workdir: Path) -> dict[str, object]:
    delivered: list[str] = []

    def send(fd: int, sig: int) -> None:
        import signal

        signal.pidfd_send_signal(fd, sig)
        delivered.append(signal.Signals(sig).name)

    killer = Killer(ProcReader(), grace_seconds=1, unkillable_seconds=1, send_signal=send)
    out: dict[str, object] = {"namespace_pid": os.getpid()}

    # 1. Reused before the killer looks: the identity check refuses.
    victim = spawn(workdir / "victim1.log")
    observed = target(victim.pid)
    victim.kill()
    victim.wait()
    time.sleep(0.05)  # a later clock tick: another start time, as a real reuse has
    impostor = spawn(workdir / "impostor1.log", pid=observed.pid)
    report = killer.stop(observed, recheck=lambda: None, before_signal=lambda sig: None)
    out["before"] = {
        "outcome": report.outcome,
        "same_pid": impostor.pid == observed.pid,
        "impostor_alive": impostor.poll() is None,
    }

    # 2. Reused after the pidfd was opened: the stale pidfd refuses (ESRCH).
    victim = spawn(workdir / "victim2.log")
    observed = target(victim.pid)
    impostors: list[subprocess.Popen[str]] = []

    def reuse_now() -> None:
        victim.kill()
        victim.wait()
        time.sleep(0.05)
        impostors.append(spawn(workdir / "impostor2.log", pid=observed.pid))

    report = killer.stop(observed, recheck=reuse_now, before_signal=lambda sig: None)
    out["after_pidfd"] = {
        "outcome": report.outcome,
        "same_pid": impostors[0].pid == observed.pid,
        "impostor_alive": impostors[0].poll() is None,
    }
    time.sleep(0.2)  # a signal, had one been sent, has been handled by now
    out["delivered"] = delivered
    out["impostor_signals"] = [
        (workdir / name).read_text() if (workdir / name).exists() else ""
        for name in ("impostor1.log", "impostor2.log")
    ]
    for process in (impostor, *impostors):
        process.kill()
        process.wait()
    return out


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]))))
