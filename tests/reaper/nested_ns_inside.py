"""Run inside a nested PID namespace that still reads the host's ``/proc``
(``unshare --pid --fork``, no ``--mount-proc``): the container with a host /proc bind
mount and no host PIDs.

Argument: a victim's host PID, start time and uid (read from the host's /proc by the
test). Here an *innocent* process is started whose PID *in this namespace* is that
number (``ns_last_pid``): ``pidfd_open`` of the number opens the innocent, while every
check of ``/proc/<pid>`` reads the host's victim. The killer is asked to stop the victim
three ways and the outcome printed as JSON: as shipped (the namespace check refuses),
without the namespace check (the pidfd's fdinfo refuses), and with neither (the setup's
proof: the innocent gets the signal).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from gpuwatch.agent.reaper.errors import PidfdUnproven
from gpuwatch.agent.reaper.killer import Killer, Target
from gpuwatch.agent.reaper.procfs import ProcReader


def innocent(pid: int) -> subprocess.Popen[str]:
    Path("/proc/sys/kernel/ns_last_pid").write_text(str(pid - 1))
    process = subprocess.Popen(
        [sys.executable, "-c", "import time; print('ready', flush=True); time.sleep(600)"],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None and process.stdout.readline().strip() == "ready"
    if process.pid != pid:
        raise SystemExit(f"could not force the PID: got {process.pid}, wanted {pid}")
    return process


def attempt(target: Target, **checks: object) -> dict[str, object]:
    sent: list[int] = []

    def send(fd: int, sig: int) -> None:
        import signal

        signal.pidfd_send_signal(fd, sig)
        sent.append(sig)

    killer = Killer(ProcReader(), grace_seconds=1, unkillable_seconds=1, send_signal=send, **checks)  # type: ignore[arg-type]
    other = innocent(target.pid)
    try:
        report = killer.stop(target, recheck=lambda: None, before_signal=lambda sig: None)
        outcome = report.outcome
    except PidfdUnproven as err:
        outcome = f"refused: {err}"
    time.sleep(0.1)
    alive = other.poll() is None
    other.kill()
    other.wait()
    return {"outcome": outcome, "sent": sent, "innocent_alive": alive}


def main() -> None:
    pid, start, uid = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
    target = Target(pid, start, uid)
    out = {
        "shipped": attempt(target),
        "fdinfo_only": attempt(target, namespace_check=lambda: None),
        "unchecked": attempt(target, namespace_check=lambda: None, pidfd_pid=lambda fd: None),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
