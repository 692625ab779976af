"""The program a stand-in process runs: a process that looks like the scenario's command.

A scenario's ``spawn = ["python", "-m", "ipykernel_launcher", ...]`` must appear, byte
for byte, in ``/proc/<pid>/cmdline`` (what ps, psutil, gpustat and nvitop read), while
the process actually only waits. ``setproctitle`` cannot do that: it writes one string
and the kernel then reports a single argument. So the supervisor starts the Python
interpreter with a one-argument placeholder argv exactly as many bytes as the command's
NUL-separated form) and feeds this file on stdin; :func:`rewrite_cmdline` then swaps
the spaces at argument boundaries for NULs in the argv area the kernel reports.

This file must only import the standard library: it runs before (and without) any
site-packages, because the interpreter's path search sees the command, not a venv.

The stand-in exits on its own when its ``deadline`` passes (the process's scenario
``exit``, or the scenario's ``lifetime``), when the runtime state file is removed or
replaced (``gpuwatch fake-nvml stop``), or on SIGTERM/SIGKILL.
"""

from __future__ import annotations

import ctypes
import os
import time
from typing import Any

_PR_SET_NAME = 15  # prctl(2): set the comm name shown by ps -o comm and psutil.name()
_STATE_POLL_SECONDS = 1.0
# If the supervisor dies before writing the state file, do not linger.
_STATE_APPEAR_SECONDS = 60.0
_UNSEEN_STATE = -1
_PR_SET_DUMPABLE = 4


def rewrite_cmdline(argv: list[str]) -> None:
    """Make ``/proc/self/cmdline`` read ``argv`` NUL-separated; set comm to its basename.

    Raises RuntimeError when this process was not started with a matching argv area.
    """
    wanted = b"".join(os.fsencode(arg) + b"\0" for arg in argv)
    with open("/proc/self/stat", "rb") as stat:
        raw = stat.read()
    fields = raw[raw.rindex(b")") + 2 :].split()
    arg_start, arg_end = int(fields[45]), int(fields[46])  # stat fields 48 and 49
    if arg_end - arg_start != len(wanted):
        raise RuntimeError(f"argv area is {arg_end - arg_start} bytes, command needs {len(wanted)}")
    ctypes.memmove(arg_start, wanted, len(wanted))
    comm = os.path.basename(os.fsencode(argv[0]))[:15]
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_NAME, ctypes.c_char_p(comm), 0, 0, 0)


def _become(uid: int, gid: int) -> None:
    """Drop root for ``uid``/``gid`` (lifecycle's ``run_as``). Done here, once the
    interpreter runs, because that user may not be allowed to execute it (a Python
    under /root). Dumpable again afterwards, so /proc shows the process as that user's."""
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_DUMPABLE, 1, 0, 0, 0)


def _state_inode(path: str) -> int | None:
    try:
        return os.stat(path).st_ino
    except FileNotFoundError:
        return None
    except PermissionError:
        # Started as another user (lifecycle's run_as), it cannot see the booter's
        # runtime dir: a constant "inode" leaves stopping it to its supervisor.
        return _UNSEEN_STATE


def run(config: dict[str, Any]) -> None:
    """Become the stand-in described by ``config`` and wait until it should exit.

    ``config``: ``argv`` (list of str), ``ready_fd`` (int; one byte is written once the
    cmdline is in place), ``deadline`` (Unix seconds), ``state_path`` (str), ``run_as``
    (``[uid, gid]`` or None).
    """
    rewrite_cmdline(config["argv"])
    if config.get("run_as"):
        _become(*config["run_as"])
    os.chdir("/")  # started in sys.base_prefix only so CPython finds its stdlib
    os.write(config["ready_fd"], b"1")
    os.close(config["ready_fd"])
    deadline, state_path = float(config["deadline"]), config["state_path"]
    started = time.time()
    seen: int | None = None
    while (now := time.time()) < deadline:
        inode = _state_inode(state_path)
        if seen is None and inode is None and now - started > _STATE_APPEAR_SECONDS:
            return
        if seen is not None and inode != seen:
            return  # stopped (removed) or rebooted (replaced): this stand-in is stale
        seen = seen if inode is None else inode
        time.sleep(min(_STATE_POLL_SECONDS, max(0.0, deadline - now)))
