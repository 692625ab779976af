"""Real processes with fake GPUs attached, for the reaper's tests (``reaper.rig``).

A :class:`Victim` is a real Python process started by the test under a non-root uid
(root and system users are protected, so a victim must be an ordinary user's); a
scenario file attaches it to a fake GPU with the memory and SM activity the test
chooses (``attach = PID``), so NVML lists it while it lives and frees its memory when
it dies, exactly as the reaper must observe. Every victim is killed at teardown.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from support.clock import FakeClock

from gpuwatch.agent.procinfo import ProcInfo
from gpuwatch.agent.sampler import HostIdentity, Sampler
from gpuwatch.nvml import fake
from gpuwatch.nvml.fake.lifecycle import stop_all
from gpuwatch.nvml.library import NvmlSession

REPO_ROOT = Path(__file__).resolve().parents[2]
ALICE = 4242  # uids with no passwd entry: users show as "4242"
BOB = 4343
GiB = 2**30

_COOPERATIVE = "import time; print('ready', flush=True); time.sleep(600)"
# Ignores SIGTERM: only SIGKILL stops it.
_STUBBORN = (
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "print('ready', flush=True); time.sleep(600)"
)


@dataclass
class Victim:
    process: subprocess.Popen[str]
    uid: int

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def exit_signal(self, timeout: float = 10.0) -> int:
        """The signal that ended it (reaps the zombie)."""
        return -self.process.wait(timeout)


def start_victim(
    *,
    uid: int = ALICE,
    stubborn: bool = False,
    name: str | None = None,
    env: dict[str, str] | None = None,
) -> Victim:
    """A real process of ``uid``; ``name`` sets its comm (PR_SET_NAME, as any process
    may), ``env`` its environment."""
    script = _STUBBORN if stubborn else _COOPERATIVE
    if name is not None:
        script = f"import ctypes; ctypes.CDLL(None).prctl(15, {name.encode()!r}, 0, 0, 0); {script}"
    command = [sys.executable, "-c", script]
    if uid != os.geteuid():
        command = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--", *command]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, cwd="/", env=env)
    assert process.stdout is not None
    assert process.stdout.readline().strip() == "ready"  # handlers are installed
    return Victim(process, uid)


def victims_fixture() -> Iterator[Callable[..., Victim]]:
    started: list[Victim] = []

    def start(*, uid: int = ALICE, stubborn: bool = False, **kw: Any) -> Victim:
        victim = start_victim(uid=uid, stubborn=stubborn, **kw)
        started.append(victim)
        return victim

    yield start
    for victim in started:
        if victim.alive():
            victim.process.kill()
        victim.process.wait(10)


@dataclass
class Hold:
    """One fake GPU context: ``pid`` holds ``memory`` on ``gpu`` at ``sm`` (a timeline),
    with its video ``encoder`` and ``decoder`` busy as given."""

    pid: int
    gpu: int = 0
    memory: str = "8GiB"
    sm: str = "0"
    encoder: str = "0"
    decoder: str = "0"


def scenario_text(holds: list[Hold], *, gpus: int = 2, memory_total: str = "16GiB") -> str:
    parts = ['[fake]\nname = "reap"\nlifetime = "10m"\n']
    parts += [f'[[gpu]]\nmemory_total = "{memory_total}"\nreserved = "0MiB"\n'] * gpus
    for h in holds:
        parts.append(
            f'[[process]]\ngpu = {h.gpu}\nattach = {h.pid}\nmemory = "{h.memory}"\nsm_percent = {h.sm}\n'
            f"encoder_percent = {h.encoder}\ndecoder_percent = {h.decoder}\n"
        )
    return "\n".join(parts)


class Rig:
    """Fake GPUs in this process (on an injected clock) and a sampler over them."""

    def __init__(self, tmp_path: Path, clock: FakeClock) -> None:
        self.tmp_path = tmp_path
        self.clock = clock
        self.runtime_dir = tmp_path / "runtime"
        self.session: NvmlSession | None = None
        self._count = 0

    def install(self, holds: list[Hold], **kwargs: object) -> Path:
        return self.install_text(scenario_text(holds, **kwargs))  # type: ignore[arg-type]

    def install_text(self, text: str) -> Path:
        """Install a whole scenario file's text (for GPUs ``scenario_text`` cannot say)."""
        self._count += 1
        path = self.tmp_path / f"reap-{self._count}.toml"
        path.write_text(text, encoding="utf-8")
        self.close()
        fake.install(path, clock=self.clock, runtime_dir=self.runtime_dir)
        self.session = NvmlSession.open()
        return path

    def sampler(self) -> Sampler:
        assert self.session is not None
        return Sampler(
            self.session,
            ProcInfo(isolated=False),
            HostIdentity("agent-test", socket.gethostname(), _boot_id()),
            timeout_seconds=5.0,
            clock=self.clock,
        )

    def close(self) -> None:
        if self.session is not None:
            self.session.close()
            self.session = None


def _boot_id() -> str:
    return Path("/proc/sys/kernel/random/boot_id").read_text().strip()


def rig_fixture(tmp_path: Path, clock: FakeClock) -> Iterator[Rig]:
    made = Rig(tmp_path, clock)
    yield made
    made.close()
    fake.uninstall()
    if made.runtime_dir.exists():
        stop_all(made.runtime_dir)


def write_config(path: Path, body: str) -> Path:
    path.write_text(textwrap.dedent(body), encoding="utf-8")
    return path


def run_cli(
    *args: str, env: dict[str, str] | None = None, user: int | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """``python -m gpuwatch ARGS`` in a child (as ``user`` when given), never on a tty."""
    command = [sys.executable, "-m", "gpuwatch", *args]
    if user is not None:
        command = [
            "setpriv",
            f"--reuid={user}",
            f"--regid={user}",
            "--clear-groups",
            "--",
            *command,
        ]
    return subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO_ROOT,
        env=env,
        stdin=subprocess.DEVNULL,
        check=False,
    )


class HistoryServer:
    """Serves a history body at ``GET /reaper/history``, as an agent would (any path:
    as an HTTP proxy it answers every request with the same body), on ``host``:``port``
    (``0``: a free port)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.body = b"{}"
        self.requests: list[str] = []
        box = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                box.requests.append(self.path)
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(box.body)))
                self.end_headers()
                self.wfile.write(box.body)

            def log_message(self, format: str, *args: object) -> None:
                pass

        self._server = ThreadingHTTPServer((host, port), Handler)
        self.port = int(self._server.server_address[1])
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(
            target=self._server.serve_forever, args=(0.01,), daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def recorded_history(rig: Rig, holds: list[Hold], *, seconds: float, step: float = 60.0) -> bytes:
    """A history as the agent would serve it after ``seconds`` of polls ending now.

    The rig's fake clock is set back ``seconds`` and walked forward to now, so the runs
    end at the real present, where the command line's own clock is.
    """
    import socket
    import time

    from gpuwatch.agent.reaper.history import ProcessHistory
    from gpuwatch.agent.reaper.served import history_report

    now = time.time()
    # Polls exactly ``step`` apart, the last one now: the fake makes one utilisation
    # sample per second, so polls closer than that would see no activity at all.
    rig.clock.now = now - seconds
    rig.install(holds)
    sampler = rig.sampler()
    hist = ProcessHistory(
        poll_interval_seconds=step, history_seconds=86400, max_gap_seconds=600, max_runs=32
    )
    for i in range(int(seconds // step) + 1):
        rig.clock.now = now - seconds + i * step
        hist.observe(sampler.poll())
    report = history_report(
        hist, hostname=socket.gethostname(), boot_id=_boot_id(), generated_at=time.time()
    )
    return report.model_dump_json().encode()
