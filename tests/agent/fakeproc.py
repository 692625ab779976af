"""A host ``/proc`` tree in the kernel's formats, written process by process.

For attribution cases the checked-in fixture tree does not hold: subuids, user
namespaces, hidden processes, zombie leaders with live threads. Boot time is
:data:`BTIME`; the tree's ``self`` is a directory, as in a fixture, never this process.
"""

from __future__ import annotations

from pathlib import Path

BTIME = 1_700_000_000
CONTAINER_ID = "0123456789abcdef" * 4


def make_root(root: Path) -> Path:
    """An empty host tree: ``stat`` with ``btime``, ``uptime`` and PID 1."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "stat").write_text(f"cpu 0 0 0 0\nbtime {BTIME}\n")
    (root / "uptime").write_text("200000.00 100000.00\n")
    write_process(root, 1, ppid=0, session=1, uid=0, comm="systemd", argv=["/sbin/init"])
    return root


def stat_line(
    pid: int, *, comm: str, state: str = "S", ppid: int, session: int, start: int = 1_000_000
) -> str:
    """``/proc/<pid>/stat``: fields 3 (state), 4 (ppid), 6 (session) and 22 (starttime)."""
    fields = [state, ppid, session, session, 0, -1, 4194560, *[0] * 10, 1, 0, start, *[0] * 30]
    return f"{pid} ({comm}) " + " ".join(map(str, fields)) + "\n"


def write_process(
    root: Path,
    pid: int,
    *,
    ppid: int = 4000,
    session: int = 4000,
    uid: int = 1000,
    comm: str = "python",
    state: str = "S",
    argv: list[str] | None = None,
    cmdline: bytes | None = None,
    cgroup: str = "0::/user.slice/user-1000.slice/session-3.scope\n",
    threads: int = 1,
    start: int = 1_000_000,
) -> Path:
    """Write one process's ``stat``, ``status``, ``cmdline`` and ``cgroup``; returns its
    directory. ``cmdline`` (raw bytes) wins over ``argv``."""
    base = root / str(pid)
    base.mkdir(parents=True, exist_ok=True)
    stat = stat_line(pid, comm=comm, state=state, ppid=ppid, session=session, start=start)
    (base / "stat").write_text(stat)
    (base / "status").write_text(
        f"Name:\t{comm}\nState:\t{state}\nTgid:\t{pid}\nPid:\t{pid}\nPPid:\t{ppid}\n"
        f"Uid:\t{uid}\t{uid}\t{uid}\t{uid}\nGid:\t{uid}\t{uid}\t{uid}\t{uid}\n"
        f"NSpid:\t{pid}\nThreads:\t{threads}\n"
    )
    if cmdline is None:
        cmdline = b"".join(arg.encode() + b"\x00" for arg in (argv or ["python", "train.py"]))
    (base / "cmdline").write_bytes(cmdline)
    (base / "cgroup").write_text(cgroup)
    return base


def write_thread(
    root: Path,
    pid: int,
    tid: int,
    *,
    state: str,
    argv: list[str],
    cgroup: str,
    comm: str = "python",
) -> None:
    """``/proc/<pid>/task/<tid>/``: one thread of ``pid``, with its own view of the files."""
    base = root / str(pid) / "task" / str(tid)
    base.mkdir(parents=True, exist_ok=True)
    (base / "stat").write_text(stat_line(tid, comm=comm, state=state, ppid=4000, session=4000))
    (base / "cmdline").write_bytes(b"".join(arg.encode() + b"\x00" for arg in argv))
    (base / "cgroup").write_text(cgroup)
