"""``python -m gpuwatch.nvml.fake.supervisor NAME``: the parent of a scenario's stand-ins.

Started once per scenario boot by :mod:`gpuwatch.nvml.fake.lifecycle`, which writes a
JSON boot plan on its stdin. The supervisor

1. forks and lets the first process exit, so it is reparented to init (or the nearest
   subreaper) and never lingers as a zombie of whichever program booted the scenario,
   and starts a new session, so Ctrl-C in that program's terminal does not reach it;
2. starts each stand-in (:mod:`gpuwatch.nvml.fake.standin`) as its own child, or, for
   ``orphan = true``, through a short-lived intermediate child that exits at once;
3. waits until every stand-in has rewritten its cmdline, records all identities in the
   runtime state file, and reports ``{"ok": true}`` (or ``{"error": ...}``) on stdout;
4. reaps its children until the scenario's deadline passes or the state file is
   removed or replaced, then terminates the stand-ins still recorded and exits.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from gpuwatch.nvml.fake.procfs import ProcessIdentity, identify, terminate
from gpuwatch.nvml.fake.runtime_state import RuntimeState, write_state

READY_TIMEOUT_SECONDS = 20.0
POLL_SECONDS = 0.5


def _standin_program(config: dict[str, Any]) -> bytes:
    """standin.py followed by a call with ``config`` (plain str/int/float/list values,
    so its repr is a valid Python literal)."""
    source = Path(__file__).with_name("standin.py").read_text(encoding="utf-8")
    return f"{source}\nrun({config!r})\n".encode()


def _placeholder_argv0(argv: list[str]) -> str:
    """The one argument the interpreter starts with: as many bytes as ``argv`` takes
    NUL-separated (minus the final NUL), so standin.py can rewrite it in place.

    It contains no "/": CPython derives its stdlib location from argv[0] when it looks
    like a path. Without one (and without PATH) it searches up from the working
    directory instead, which is why stand-ins start in ``sys.base_prefix``.
    """
    size = sum(len(os.fsencode(arg)) + 1 for arg in argv)
    return "_" * (size - 1)


def _start_standin(plan: dict[str, Any], state_path: str, ready_write: int) -> int:
    """Start one stand-in, which writes a byte to ``ready_write`` once it looks right."""
    argv: list[str] = plan["argv"]
    program = _standin_program(
        {
            "argv": argv,
            "ready_fd": ready_write,
            "deadline": plan["deadline"],
            "state_path": state_path,
            "run_as": plan.get("run_as"),
        }
    )
    child = subprocess.Popen(
        [_placeholder_argv0(argv)],
        executable=sys.executable,
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=dict(plan["env"]),
        # CPython finds its stdlib by searching up from here (see above); from "/" it
        # could find another Python's /lib/python3.X. The stand-in then moves to "/".
        cwd=sys.base_prefix,
        pass_fds=(ready_write,),
    )
    assert child.stdin is not None
    child.stdin.write(program)
    child.stdin.close()
    return child.pid


def _start_orphan(plan: dict[str, Any], state_path: str, ready_write: int) -> int:
    """Start a stand-in through a child that exits at once, so the stand-in is reparented."""
    report_read, report_write = os.pipe()
    intermediate = os.fork()  # safe: the supervisor is single-threaded
    if intermediate == 0:
        try:
            os.write(report_write, str(_start_standin(plan, state_path, ready_write)).encode())
        finally:
            os._exit(0)
    os.close(report_write)
    with os.fdopen(report_read, "rb") as report:
        text = report.read().decode()
    os.waitpid(intermediate, 0)
    if not text:
        raise RuntimeError(f"could not start orphan stand-in {plan['argv'][0]}")
    return int(text)


def _wait_ready(pid: int, ready_read: int, program: str, deadline: float) -> None:
    try:
        readable, _, _ = select.select([ready_read], [], [], max(0.0, deadline - time.monotonic()))
        if not readable or os.read(ready_read, 1) != b"1":
            raise RuntimeError(f"stand-in {pid} ({program}) did not start")
    finally:
        os.close(ready_read)


def _boot(plan: dict[str, Any], standins: list[ProcessIdentity]) -> RuntimeState:
    """Start every stand-in (appending each to ``standins`` as soon as it is known)."""
    state_path = plan["state_path"]
    processes = {key: ProcessIdentity(*value) for key, value in plan["attached"].items()}
    pending: list[tuple[str, int, int, str]] = []
    for standin in plan["standins"]:
        start = _start_orphan if standin["orphan"] else _start_standin
        ready_read, ready_write = os.pipe()
        try:
            pid = start(standin, state_path, ready_write)
        finally:
            os.close(ready_write)
        standins.append(identify(pid))
        pending.append((standin["key"], pid, ready_read, standin["argv"][0]))
    deadline = time.monotonic() + READY_TIMEOUT_SECONDS
    for key, pid, ready_read, program in pending:
        _wait_ready(pid, ready_read, program, deadline)
        processes[key] = identify(pid)
    state = RuntimeState(
        scenario=plan["scenario"],
        content_hash=plan["content_hash"],
        boot_id=plan["boot_id"],
        epoch=plan["epoch"],
        deadline=plan["deadline"],
        supervisor=identify(os.getpid()),
        processes=processes,
        standins=tuple(key for key, *_ in pending),
    )
    write_state(Path(state_path), state)
    return state


def _watch(state: RuntimeState, state_path: Path) -> None:
    """Reap children until the deadline, or until the state file goes away or changes."""
    inode = state_path.stat().st_ino
    while time.time() < state.deadline:
        try:
            while os.waitpid(-1, os.WNOHANG)[0] > 0:
                pass
        except ChildProcessError:
            pass  # no children left (all orphans, or all exited)
        try:
            if state_path.stat().st_ino != inode:
                return
        except FileNotFoundError:
            return
        time.sleep(POLL_SECONDS)


def _report(message: dict[str, Any]) -> None:
    """Tell the booting process how the boot went, then let go of its pipes."""
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    os.close(devnull)


def main() -> None:
    plan = json.loads(sys.stdin.read())
    if os.fork() > 0:
        os._exit(0)
    os.setsid()
    # SIGTERM (from `stop`) unwinds through the finally below, like a normal exit.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    standins: list[ProcessIdentity] = []
    try:
        try:
            state = _boot(plan, standins)
        except (OSError, RuntimeError, ValueError) as err:
            _report({"error": str(err)})
            return
        _report({"ok": True})
        _watch(state, Path(plan["state_path"]))
    finally:
        # Only the stand-ins: attached PIDs (the booting program itself) are never signalled.
        terminate(standins)


if __name__ == "__main__":
    main()
