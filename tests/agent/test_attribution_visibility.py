"""Alive, dead or hidden: only "no such process" makes a PID dead, and a process read
while it exits is never reported alive with a half-read identity.

Fake ``/proc`` trees in the kernel's formats (:mod:`agent.fakeproc`), and, where the
kernel's own behaviour is the point, a real ``hidepid`` procfs and real processes.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest

from agent.fakeproc import CONTAINER_ID, make_root, stat_line, write_process, write_thread
from gpuwatch.agent.procinfo import ProcInfo

DEADLINE_SECONDS = 10.0


def info(root: Path) -> ProcInfo:
    return ProcInfo(root, isolated=False)


# --- a read refused is not an exit ------------------------------------------------------------


def test_a_pid_whose_stat_cannot_be_read_is_hidden_not_dead(tmp_path: Path) -> None:
    root = make_root(tmp_path)
    write_process(root, 5001)
    (root / "5001" / "stat").unlink()
    (root / "5001" / "stat").mkdir()  # any error but ENOENT/ESRCH (here EISDIR)

    facts = info(root).describe(5001)

    assert (facts.alive, facts.visible) == (True, False)
    assert facts.user is None and facts.command is None  # unknown, not guessed


def test_a_pid_missing_from_a_fixture_tree_is_still_dead(tmp_path: Path) -> None:
    # kill(pid, 0) confirms only on this process's own procfs, never on a fixture tree.
    facts = info(make_root(tmp_path)).describe(os.getpid())
    assert (facts.alive, facts.visible) == (False, True)


def _unshare_and_setpriv() -> None:
    if os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("setpriv"):
        pytest.skip("needs root, unshare and setpriv")


HIDDEN_READER = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    from gpuwatch.agent.procinfo import ProcInfo
    info = ProcInfo(Path(sys.argv[1]), isolated=False)
    pids = [int(p) for p in sys.argv[2:]]
    print(json.dumps({
        "facts": [[f.alive, f.visible, f.user] for f in map(info.describe, pids)],
        "notes": info.reader_notes,
    }))
    """
)


@pytest.mark.parametrize("hidepid", ["invisible", "noaccess"])
def test_a_process_hidepid_hides_is_alive_and_hidden(hidepid: str) -> None:
    """uid 65534 reads a procfs mounted hidepid=2 (the directory is absent: kill(pid, 0)
    says EPERM) or hidepid=1 (stat says EACCES) in which uid 1000's job runs."""
    _unshare_and_setpriv()
    # Not under tmp_path: pytest's base directory is 0700, and a path uid 65534 cannot
    # walk is itself a refused read (hidden, rightly) for every PID.
    with tempfile.TemporaryDirectory(prefix="gw-hidepid-") as where:
        mount = Path(where)
        mount.chmod(0o755)
        seen = _read_as_nobody(mount, hidepid)
    assert seen["facts"] == [[True, False, None], [False, True, None]]  # hidden; really gone
    assert any(f"hidepid={hidepid}" in note for note in seen["notes"])


def _read_as_nobody(mount: Path, hidepid: str) -> dict[str, Any]:
    job = subprocess.Popen(
        ["setpriv", "--reuid=1000", "--regid=1000", "--clear-groups", "sleep", "30"]
    )
    gone = subprocess.Popen(["true"])
    gone.wait()
    try:
        script = (
            f"mount -t proc -o hidepid={hidepid} proc {mount} && exec setpriv --reuid=65534"
            f" --regid=65534 --clear-groups {sys.executable} -c '{HIDDEN_READER}'"
            f" {mount} {job.pid} {gone.pid}"
        )
        result = subprocess.run(
            ["unshare", "-m", "sh", "-c", script],
            capture_output=True,
            text=True,
            timeout=DEADLINE_SECONDS,
            check=True,
            cwd="/",
            env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])},
        )
    finally:
        job.kill()
        job.wait()
    seen: dict[str, Any] = json.loads(result.stdout)
    return seen


# --- a process read while it exits ------------------------------------------------------------


def test_a_process_that_exits_while_it_is_read_is_not_alive(tmp_path: Path) -> None:
    """Its cmdline is a FIFO: the "kernel" turns it into a zombie (same start time, empty
    cmdline) at the moment the reader opens it, then lets the read end."""
    root = make_root(tmp_path)
    base = write_process(root, 7101, cgroup=f"0::/system.slice/docker-{CONTAINER_ID}.scope\n")
    (base / "cmdline").unlink()
    os.mkfifo(base / "cmdline")

    def exit_during_the_read() -> None:
        with open(base / "cmdline", "wb"):  # returns once the reader has opened it
            (base / "stat").write_text(
                stat_line(7101, comm="python", state="Z", ppid=4000, session=4000)
            )
        # closing it ends the reader's read: an empty cmdline, as a zombie's

    exiting = threading.Thread(target=exit_during_the_read)
    exiting.start()
    procinfo = info(root)
    facts = procinfo.describe(7101)
    exiting.join(DEADLINE_SECONDS)

    assert not facts.alive
    assert facts.command is None
    # Nor was the half-read identity cached for the next poll.
    (base / "cmdline").unlink()
    write_process(root, 7101, state="Z")
    assert not procinfo.describe(7101).alive


# --- a zombie leader whose threads still run ------------------------------------------------


def test_a_zombie_leader_with_live_threads_is_read_through_a_live_thread(tmp_path: Path) -> None:
    """``Zl``: the main thread called pthread_exit. The leader's cmdline is empty and its
    v1 cgroups read "/"; a live thread still has both."""
    root = make_root(tmp_path)
    job_cgroup = "12:memory:/slurm/uid_1000/job_77/step_0/task_0\n1:name=systemd:/system.slice/slurmd.service\n"
    write_process(
        root, 5005, state="Z", threads=3, cmdline=b"", cgroup="12:memory:/\n1:name=systemd:/\n"
    )
    write_thread(root, 5005, 5005, state="Z", argv=[], cgroup="12:memory:/\n")
    write_thread(root, 5005, 5007, state="Z", argv=[], cgroup="12:memory:/\n")  # exiting too
    write_thread(
        root, 5005, 5009, state="S", argv=["python", "train.py", "--big"], cgroup=job_cgroup
    )

    facts = info(root).describe(5005)

    assert facts.alive
    assert facts.command == "python train.py --big"
    assert facts.owner.slurm_job_id == "77"


# --- the command as run -----------------------------------------------------------------------


def test_an_empty_argument_is_shown_not_dropped(tmp_path: Path) -> None:
    root = make_root(tmp_path)
    write_process(root, 5006, cmdline=b"python\x00train.py\x00--run-name\x00\x00--epochs\x003\x00")
    assert info(root).describe(5006).command == "python train.py --run-name '' --epochs 3"


def test_a_retitled_process_padding_is_not_shown_as_empty_arguments(tmp_path: Path) -> None:
    # setproctitle (Ray workers, gunicorn) pads the old argv area with NULs.
    root = make_root(tmp_path)
    write_process(root, 5008, cmdline=b"ray::Trainer.train" + b"\x00" * 40)
    assert info(root).describe(5008).command == "ray::Trainer.train"
