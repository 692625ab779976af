"""gpuwatch.torch (and the snapshot fetch it shares with ``gpuwatch explain``) against
whatever may listen on the agent's port: one that drips its answer, one that sends
gigabytes, another user's, and a proxy the job's environment names.

The promise is the training job's: never hang it, never grow it, never send its data
to another user, never print into its logs or stderr. Real sockets, a real
subprocess for the uncaught-OOM path.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest

import gpuwatch.torch as gt
from doctor.cli_run import run
from doctor.fake_agent_server import FakeAgent
from gpuwatch.torch import AllocatorSample
from gpuwatch.wire import INCIDENTS_OOM_PATH, TORCH_PATH

GIB = 2**30
OOM = (
    "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 23.65 GiB of "
    "which 1.12 GiB is free. Including non-PyTorch memory, this process has 22.51 GiB memory in "
    "use. Of the allocated memory 20.87 GiB is allocated by PyTorch, and 1.19 GiB is reserved by "
    "PyTorch but unallocated."
)
# A hostile listener gives up after this long, so that a reporter without a deadline
# fails these tests by taking this long instead of hanging the test run.
STALL_SECONDS = 30.0


class OneDevice:
    def devices(self) -> list[int]:
        return [0]

    def sample(self, device: int) -> AllocatorSample:
        return AllocatorSample(device, GIB, 2 * GIB, 2 * GIB)

    def reset_peak(self, device: int) -> None:
        pass

    def total_memory(self, device: int) -> int | None:
        return 24 * GIB


@dataclass
class Listener:
    """A TCP listener on 127.0.0.1 answering each connection with ``answer``."""

    answer: Callable[[socket.socket], None]
    url: str = ""
    requests: list[bytes] = field(default_factory=list)
    sent: int = 0  # body bytes the client took before it hung up
    _server: socket.socket | None = None

    def serve(self) -> None:
        assert self._server is not None
        while True:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(STALL_SECONDS)
            try:
                head = b""
                while b"\r\n\r\n" not in head:
                    chunk = conn.recv(65536)
                    if not chunk:
                        return
                    head += chunk
                self.requests.append(head)
                self.answer(conn)
            except OSError:
                pass  # the client hung up: what these tests want


@pytest.fixture
def listen() -> Iterator[Callable[[Callable[[Listener, socket.socket], None]], Listener]]:
    servers: list[socket.socket] = []

    def start(answer: Callable[[Listener, socket.socket], None]) -> Listener:
        server = socket.create_server(("127.0.0.1", 0))
        servers.append(server)
        listener = Listener(answer=lambda conn: answer(listener, conn), _server=server)
        listener.url = f"http://127.0.0.1:{server.getsockname()[1]}"
        threading.Thread(target=listener.serve, daemon=True).start()
        return listener

    yield start
    for server in servers:
        server.close()


def drip_body(listener: Listener, conn: socket.socket) -> None:
    """Headers at once, then one body byte every 0.1 s (each read is quick)."""
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n")
    _drip(conn, b" " * 1000)


def drip_head(listener: Listener, conn: socket.socket) -> None:
    """The status line and headers themselves, one byte every 0.1 s."""
    _drip(conn, b"HTTP/1.1 200 OK\r\nX-Slow: " + b"a" * 10000)


def _drip(conn: socket.socket, data: bytes) -> None:
    stop = time.monotonic() + STALL_SECONDS
    for byte in data:
        if time.monotonic() > stop:
            return
        conn.sendall(bytes([byte]))
        time.sleep(0.1)


HUGE = 256 * 2**20


def huge_chunked(listener: Listener, conn: socket.socket) -> None:
    """A 256 MiB answer without a Content-Length (chunked), as fast as it is read."""
    conn.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
    chunk = b"x" * 2**20
    for _ in range(HUGE // len(chunk)):
        conn.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        listener.sent += len(chunk)
    conn.sendall(b"0\r\n\r\n")


def answer_204(listener: Listener, conn: socket.socket) -> None:
    conn.sendall(b"HTTP/1.1 204 No Content\r\nContent-Length: 0\r\n\r\n")


@pytest.fixture(autouse=True)
def clean_install() -> Iterator[None]:
    yield
    gt.uninstall()


# -- 1. a deadline on the whole exchange, and a bound on the answer ------------------------


@pytest.mark.parametrize("answer", [drip_body, drip_head], ids=["body", "head"])
def test_a_report_to_a_dripping_listener_ends_within_its_deadline(
    listen: Callable[..., Listener], answer: Callable[[Listener, socket.socket], None]
) -> None:
    listener = listen(answer)
    reporter = gt.Reporter(agent_url=listener.url, stats=OneDevice())
    started = time.monotonic()
    assert reporter.report_once() == 0
    # Bounded by the deadline, far from the listener's STALL_SECONDS: a third of it leaves
    # room for a loaded CI machine and still fails a reporter that waits on the listener.
    assert time.monotonic() - started < STALL_SECONDS / 3


@pytest.mark.parametrize("answer", [drip_body, drip_head], ids=["body", "head"])
def test_explain_against_a_dripping_agent_ends_within_its_deadline(
    listen: Callable[..., Listener],
    answer: Callable[[Listener, socket.socket], None],
    capsys: pytest.CaptureFixture[str],
) -> None:
    listener = listen(answer)
    run(["explain", OOM], capsys)  # imports paid here, not inside the measured run
    started = time.monotonic()
    code, out, _ = run(["explain", "--agent", listener.url, OOM], capsys)
    assert code == 0 and "Out of memory" in out  # from the message alone
    # The fetch's deadline is 0.5 s; a fetch without one waits for STALL_SECONDS.
    assert time.monotonic() - started < STALL_SECONDS / 3


def test_an_endless_answer_is_dropped_not_buffered(listen: Callable[..., Listener]) -> None:
    listener = listen(huge_chunked)
    reporter = gt.Reporter(agent_url=listener.url, stats=OneDevice())
    assert reporter.report_once() == 0  # an answer no agent sends: not taken
    time.sleep(0.2)
    # The reporter hung up after a bounded read; the rest was never sent, so never held.
    assert listener.sent < HUGE // 4


_OOM_SCRIPT = textwrap.dedent(
    """
    import sys
    import gpuwatch.torch as gt
    from gpuwatch.torch import AllocatorSample

    class OneDevice:
        def devices(self): return [0]
        def sample(self, d): return AllocatorSample(d, 1 << 30, 2 << 30, 2 << 30)
        def reset_peak(self, d): pass
        def total_memory(self, d): return 24 << 30

    gt.install(stats=OneDevice(), interval_seconds=float(sys.argv[1]))
    if sys.argv[2] == "thread":  # the reporter thread's posts, then a clean exit
        import time; time.sleep(1.0); sys.exit(0)
    raise RuntimeError(sys.argv[3])
    """
)


def run_job(
    agent_url: str, *, interval: float = 3600, mode: str = "oom", env: dict[str, str] | None = None
) -> tuple[subprocess.CompletedProcess[str], float]:
    """A training script with install() and an uncaught OOM (or a second of reports)."""
    environment = {**os.environ, "GPUWATCH_AGENT_URL": agent_url, **(env or {})}
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", _OOM_SCRIPT, str(interval), mode, OOM],
        capture_output=True,
        text=True,
        env=environment,
        timeout=60,
    )
    return done, time.monotonic() - started


@pytest.mark.parametrize("answer", [drip_body, drip_head], ids=["body", "head"])
def test_an_oom_job_exits_within_seconds_whatever_the_listener_does(
    listen: Callable[..., Listener], answer: Callable[[Listener, socket.socket], None]
) -> None:
    listener = listen(answer)
    done, took = run_job(listener.url)
    assert done.returncode == 1  # the user's OOM, uncaught
    assert "gpuwatch: diagnosis of this out-of-memory error" in done.stderr
    assert done.stderr.rstrip().endswith(OOM)
    # The snapshot's deadline (0.5 s) and the incident's (2 s), and the start-up (about
    # 3 s in all on a quiet machine); without the deadlines, STALL_SECONDS.
    assert took < STALL_SECONDS / 2.5, done.stderr


# -- 2. never through a proxy; a broken proxy variable breaks nothing ------------------------


@pytest.mark.parametrize("variable", ["HTTP_PROXY", "http_proxy", "ALL_PROXY"])
def test_reports_reach_the_agent_not_the_proxy_the_environment_names(
    listen: Callable[..., Listener],
    agent: FakeAgent,
    monkeypatch: pytest.MonkeyPatch,
    variable: str,
) -> None:
    proxy = listen(answer_204)
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.setenv(variable, proxy.url)
    reporter = gt.Reporter(agent_url=agent.url, stats=OneDevice())
    assert reporter.report_once() == 1
    reporter.handle_oom(RuntimeError(OOM), stream=sys.stderr)
    assert len(agent.posts[TORCH_PATH]) == 1 and len(agent.posts[INCIDENTS_OOM_PATH]) == 1
    assert proxy.requests == []


BROKEN_PROXIES = [
    {"ALL_PROXY": "socks5://127.0.0.1:1"},  # socksio is not installed
    {"HTTP_PROXY": "garbage://x"},
    {"HTTP_PROXY": "http://[::1"},
]


@pytest.mark.parametrize("env", BROKEN_PROXIES, ids=lambda e: next(iter(e.values())))
def test_a_broken_proxy_variable_breaks_neither_reports_nor_the_diagnosis(
    agent: FakeAgent, env: dict[str, str]
) -> None:
    done, _ = run_job(agent.url, interval=0.05, mode="thread", env=env)
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""  # no "Exception in thread gpuwatch-torch-reporter"
    assert len(agent.posts.get(TORCH_PATH, [])) >= 2
    done, _ = run_job(agent.url, env=env)
    assert "gpuwatch: diagnosis of this out-of-memory error" in done.stderr
    assert "could not diagnose" not in done.stderr
    # One traceback: the user's OOM, passed on untouched.
    assert done.stderr.count("Traceback") == 1 and done.stderr.rstrip().endswith(OOM)
    assert len(agent.posts.get(INCIDENTS_OOM_PATH, [])) == 1


# -- 3. never post to another user's listener -----------------------------------------------


def test_nothing_is_posted_to_a_port_another_user_owns(
    agent: FakeAgent, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from gpuwatch.agent.reaper import served

    port = int(agent.url.rsplit(":", 1)[1])
    stranger = served.Listener(uid=65534, inode=1)
    real = served.listeners
    monkeypatch.setattr(served, "listeners", lambda p, *a: [stranger] if p == port else real(p, *a))
    reporter = gt.Reporter(agent_url=agent.url, stats=OneDevice())
    with caplog.at_level(logging.DEBUG, logger="gpuwatch"):
        assert reporter.report_once() == 0
        assert reporter.report_once() == 0
        reporter.handle_oom(RuntimeError(OOM), stream=sys.stderr)
    assert agent.posts == {}  # neither the figures nor the OOM message
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    # Once for the reports (not every interval), once each for the snapshot and the incident.
    assert sum("uid 65534" in w and TORCH_PATH in w for w in warnings) == 1
    assert any("uid 65534" in w and INCIDENTS_OOM_PATH in w for w in warnings)


def test_a_port_that_changes_hands_is_noticed(
    agent: FakeAgent, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gpuwatch.agent.reaper import served

    reporter = gt.Reporter(agent_url=agent.url, stats=OneDevice())
    assert reporter.report_once() == 1  # the agent's own listener: trusted
    port = int(agent.url.rsplit(":", 1)[1])
    stranger = served.Listener(uid=65534, inode=1)
    real = served.listeners
    monkeypatch.setattr(served, "listeners", lambda p, *a: [stranger] if p == port else real(p, *a))
    # The OOM message is never sent on an earlier check.
    reporter.handle_oom(RuntimeError(OOM), stream=sys.stderr)
    assert INCIDENTS_OOM_PATH not in agent.posts
    # Nor reports, once the recheck is due.
    monkeypatch.setattr(gt, "LISTENER_RECHECK_SECONDS", 0.0)
    assert reporter.report_once() == 0
    assert len(agent.posts[TORCH_PATH]) == 1


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv"
)
def test_another_users_real_listener_receives_nothing(tmp_path: os.PathLike[str]) -> None:
    server = textwrap.dedent(
        """
        import socket, sys
        s = socket.create_server(("127.0.0.1", 0)); print(s.getsockname()[1], flush=True)
        while True:
            c, _ = s.accept(); print("REQUEST", c.recv(65536)[:40], flush=True)
            c.sendall(b"HTTP/1.1 204 No Content\\r\\nContent-Length: 0\\r\\n\\r\\n"); c.close()
        """
    )
    command = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--"]
    nobody = subprocess.Popen(
        [*command, sys.executable, "-c", server], stdout=subprocess.PIPE, text=True, cwd="/"
    )
    try:
        assert nobody.stdout is not None
        url = f"http://127.0.0.1:{nobody.stdout.readline().strip()}"
        reporter = gt.Reporter(agent_url=url, stats=OneDevice())
        assert reporter.report_once() == 0
        reporter.handle_oom(RuntimeError(OOM), stream=sys.stderr)
    finally:
        nobody.terminate()
        out, _ = nobody.communicate(timeout=10)
    assert "REQUEST" not in out


# -- 5. nothing in the job's logs per request -----------------------------------------------


def test_no_log_line_per_request_at_info(
    agent: FakeAgent, caplog: pytest.LogCaptureFixture
) -> None:
    httpx_logger = logging.getLogger("httpx")
    before = (httpx_logger.level, list(httpx_logger.filters))
    reporter = gt.Reporter(agent_url=agent.url, stats=OneDevice())
    with caplog.at_level(logging.INFO):  # a training script's logging.basicConfig(INFO)
        assert reporter.report_once() == 1
        assert reporter.report_once() == 1
    assert [r.getMessage() for r in caplog.records] == []
    # The user's own httpx logging is untouched (whatever other code set up before).
    assert (httpx_logger.level, list(httpx_logger.filters)) == before
