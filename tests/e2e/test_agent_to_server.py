"""The whole path as deployed: `gpuwatch agent` pushing to `gpuwatch server` over real HTTP.

Both run as real processes from the CLI, on simulated GPUs and a real SQLite file. The
server is stopped and started again in the middle, and the promise checked at the end
is the reporter's: every snapshot the agent offered is stored exactly once, or counted
as dropped, and here nothing was dropped.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

GPUWATCH = [sys.executable, "-m", "gpuwatch"]
DEADLINE = 60.0

SCENARIO = """
[fake]
name = "e2e"
lifetime = "10m"

[[gpu]]
name = "NVIDIA A100-SXM4-80GB"
memory_total = "80GiB"

[[process]]
gpu = 0
spawn = ["python", "eval.py", "--checkpoint", "last.ckpt"]
orphan = true
memory = "9GiB"
sm_percent = 20

[[process]]
gpu = 0
ghost = 4100001
memory = "3GiB"
"""


def _wait(predicate: Callable[[], object], what: str) -> object:
    deadline = time.monotonic() + DEADLINE
    while time.monotonic() < deadline:
        try:
            value = predicate()
        except httpx.HTTPError:
            value = None
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


class Stack:
    """A server and an agent started from the CLI, and what the test needs to see them."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.db = tmp / "gpuwatch.db"
        self.db_url = f"sqlite:///{self.db}"
        self.env = {
            **os.environ,
            "XDG_RUNTIME_DIR": str(tmp / "run"),
            "GPUWATCH_CONFIG": "/dev/null",
            "GPUWATCH_AGENT_SPOOL_DIR": str(tmp / "spool"),
            "GPUWATCH_AGENT_PUSH_INTERVAL_SECONDS": "0.3",
            "GPUWATCH_SERVER_DATA_DIR": str(tmp / "data"),
        }
        (tmp / "run").mkdir()
        self.scenario = tmp / "e2e.toml"
        self.scenario.write_text(SCENARIO)
        self.processes: list[subprocess.Popen[str]] = []
        self.server: subprocess.Popen[str] | None = None
        self.server_port = 0

    def cli(self, *args: str) -> str:
        result = subprocess.run(
            [*GPUWATCH, *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert result.returncode == 0, result.stderr
        return result.stdout

    def _start(self, args: list[str], banner: str) -> tuple[subprocess.Popen[str], str]:
        proc = subprocess.Popen([*GPUWATCH, *args], env=self.env, stderr=subprocess.PIPE, text=True)
        self.processes.append(proc)
        assert proc.stderr is not None
        line = proc.stderr.readline()
        match = re.search(rf"{banner} (http://\S+)", line)
        assert match, f"unexpected first line: {line!r}"
        return proc, match.group(1).removesuffix("/metrics")

    def start_server(self) -> str:
        self.server, url = self._start(
            ["server", "--listen", f"127.0.0.1:{self.server_port}", "--database-url", self.db_url],
            "listening on",
        )
        self.server_port = int(url.rsplit(":", 1)[1])
        _wait(lambda: httpx.get(f"{url}/healthz").status_code == 200, "server health")
        return url

    def stop_server(self) -> None:
        assert self.server is not None
        self.server.send_signal(signal.SIGTERM)
        self.server.wait(timeout=30)

    def start_agent(self, server_url: str, token: str) -> str:
        _, url = self._start(
            ["agent", "--fake-gpus", str(self.scenario), "--listen", "127.0.0.1:0",
             "--poll-interval", "0.2", "--server", server_url, "--token", token],
            "serving",
        )  # fmt: skip
        _wait(lambda: httpx.get(f"{url}/healthz").status_code == 200, "agent health")
        return url

    def boot(self, hostname: str) -> tuple[str, str]:
        """Migrate, make this host's token, start server then agent; their base URLs."""
        self.cli("db", "upgrade", "--database-url", self.db_url)
        created = self.cli("token", "create", hostname, "--database-url", self.db_url)
        token = created.strip().splitlines()[-1]  # the token is the last line, by contract
        server = self.start_server()
        return server, self.start_agent(server, token)

    def close(self) -> None:
        for proc in self.processes:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()
        subprocess.run(
            [*GPUWATCH, "fake-nvml", "stop", "--all"], env=self.env, capture_output=True, timeout=60
        )


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    s = Stack(tmp_path)
    yield s
    s.close()


def _metric(agent_url: str, name: str, labels: str = "") -> float:
    text = httpx.get(f"{agent_url}/metrics").text
    pattern = (
        re.escape(name) + (re.escape("{" + labels + "}") if labels else r"(?:\{\})?") + r" (\S+)"
    )
    match = re.search(rf"^{pattern}$", text, re.M)
    return float(match.group(1)) if match else 0.0


def test_orphan_reaches_the_server_and_an_outage_loses_nothing(stack: Stack) -> None:
    hostname = socket.gethostname()
    server, agent = stack.boot(hostname)

    # The reparented stand-in is a real process whose parent exited: an orphaned event.
    orphan_pid = next(
        p["pid"]
        for p in httpx.get(f"{agent}/snapshot").json()["gpus"][0]["processes"]
        if p["orphaned"]
    )

    def orphaned_events() -> list[dict[str, object]]:
        body = httpx.get(f"{server}/api/v1/events", params={"kind": "orphaned"}).json()
        items = body["items"] if isinstance(body, dict) else body
        return [e for e in items if e.get("pid") == orphan_pid]

    events = _wait(orphaned_events, "an orphaned event for the stand-in")
    assert events[0]["hostname"] == hostname  # type: ignore[index]
    assert events[0]["reason"] == "reparented" and events[0]["open"] is True  # type: ignore[index]

    # `gpuwatch explain` on this host brings the server's last hour on that GPU along.
    oom = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.15 GiB of which 20.00 MiB is free."
    explained = json.loads(
        stack.cli("explain", "--no-live", "--server", server, "--json", "--text", oom)
    )
    assert any(e["kind"] == "orphaned" and e["pid"] == orphan_pid for e in explained["history"])

    # Outage: the agent keeps polling and spools what it cannot send.
    stack.stop_server()
    _wait(lambda: _metric(agent, "gpuwatch_agent_spool_pending") >= 3, "snapshots spooled")
    server = stack.start_server()  # same port, same database
    _wait(lambda: _metric(agent, "gpuwatch_agent_spool_pending") == 0, "the spool to drain")

    # Stop the server, then compare what the agent says it delivered with what is stored.
    # With the server gone nothing more is stored, and the agent's counts can only lag
    # by the one push that was in flight: stored but not yet (or never) counted accepted.
    stack.stop_server()
    accepted = _metric(agent, "gpuwatch_agent_snapshots_pushed_total", 'result="accepted"')
    duplicate = _metric(agent, "gpuwatch_agent_snapshots_pushed_total", 'result="duplicate"')
    dropped = sum(
        float(v)
        for v in re.findall(
            r"^gpuwatch_agent_snapshots_dropped_total\{[^}]*\} (\S+)$",
            httpx.get(f"{agent}/metrics").text,
            re.M,
        )
    )
    with sqlite3.connect(stack.db) as db:
        stored = db.execute("SELECT count(*) FROM snapshots_seen").fetchone()[0]
    assert dropped == 0
    assert accepted >= 5
    # Each stored once: a snapshot whose response was lost comes back as a duplicate.
    assert stored in range(int(accepted + duplicate), int(accepted + duplicate) + 2)


def test_oom_incident_from_a_training_process_is_recorded_with_who_was_there(stack: Stack) -> None:
    hostname = socket.gethostname()
    server, agent = stack.boot(hostname)
    message = (
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a "
        "total capacity of 79.15 GiB of which 120.00 MiB is free."
    )
    # What gpuwatch.torch posts when the OOM handler fires (tests/doctor covers that side).
    response = httpx.post(
        f"{agent}/incidents/oom",
        json={"pid": os.getpid(), "device_index": 0, "message": message,
              "explanation": {"recognized": True, "kind": "pytorch_allocator"}, "occurred_at": time.time()},
    )  # fmt: skip
    assert response.status_code == 202

    def oom_events() -> list[dict[str, object]]:
        return httpx.get(f"{server}/api/v1/events", params={"kind": "oom"}).json()["items"]  # type: ignore[no-any-return]

    (event,) = _wait(oom_events, "the OOM event")  # type: ignore[misc]
    assert event["hostname"] == hostname and event["pid"] == os.getpid()
    evidence = event["evidence"]
    assert evidence["explanation"]["kind"] == "pytorch_allocator"
    # The agent attached its view of the GPU at that moment: who else was on it.
    pids = {p["pid"] for p in evidence["gpu"]["processes"]}
    assert 4100001 in pids
