"""`gpuwatch demo`, the README's first command, end to end on simulated GPUs.

The demo runs as a user would run it (a child process, real stand-ins, real HTTP),
scaled down with ``--speed 3``: every planted problem must be found by the server and
be visible in its API and on the dashboard, the filling-up alert must reach the demo's
webhook, the printed ``gpuwatch reap`` command must stop the idle notebook, and Ctrl-C
must stop exactly what the demo started, not another run's stand-ins on the same host.
"""

from __future__ import annotations

import html
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

SPEED = "3"
# At --speed 3 the filling-up alert reaches the webhook about 35 s after the start
# (leak window 20 s, bucket 2 s, rule `for` 3.3 s, group_wait 1.7 s, plus start-up);
# the bound leaves room for a loaded 2-core machine.
FOUND_WITHIN_SECONDS = 75.0


def _alive(pid: int) -> bool:
    """Running and not a zombie (stopped stand-ins may wait for init to reap them)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] not in "ZX"


def _state_pids(path: Path) -> list[int]:
    state = json.loads(path.read_text())
    return [state["processes"][key][0] for key in state["standins"]]


@pytest.fixture
def env(tmp_path: Path) -> Iterator[dict[str, str]]:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("GPUWATCH_")}
    environment |= {"XDG_RUNTIME_DIR": str(tmp_path), "GPUWATCH_CONFIG": "/dev/null"}
    yield environment
    subprocess.run(
        [sys.executable, "-m", "gpuwatch", "fake-nvml", "stop", "--all"],
        env=environment, capture_output=True, timeout=60, check=False,
    )  # fmt: skip


def _lines(stream: Any) -> Callable[[float], dict[str, Any] | None]:
    """The demo's JSON lines, read in a thread; ``next_line(timeout)``."""
    box: queue.Queue[dict[str, Any] | None] = queue.Queue()

    def pump() -> None:
        for raw in stream:
            box.put(json.loads(raw))
        box.put(None)

    threading.Thread(target=pump, daemon=True).start()

    def next_line(timeout: float) -> dict[str, Any] | None:
        try:
            return box.get(timeout=max(0.01, timeout))
        except queue.Empty:
            return None

    return next_line


def _wait_for_problems(next_line: Callable[[float], Any]) -> tuple[list[Any], list[Any]]:
    """Found events and notifications, once every planted problem has shown."""
    found: list[dict[str, Any]] = []
    notifications: list[dict[str, Any]] = []

    def complete() -> bool:
        seen = {(f["hostname"], f["kind"], f["reason"]) for f in found}
        rules = {a["rule"] for n in notifications for a in n["alerts"]}
        return {
            ("gpu-c", "orphaned", "reparented"),
            ("gpu-c", "orphaned", "dead_pid"),
            ("gpu-b", "idle", "idle"),
            ("gpu-a", "runaway", "leak"),
            ("gpu-a", "filling_up", "filling_up"),
        } <= seen and "gpu_filling_up_warning" in rules

    deadline = time.monotonic() + FOUND_WITHIN_SECONDS
    while not complete():
        line = next_line(deadline - time.monotonic())
        assert line is not None, f"not everything was found in time: {found}, {notifications}"
        if line["event"] == "found":
            found.append(line)
        elif line["event"] == "notification":
            notifications.append(line)
    return found, notifications


def _check_api_and_page(server: str) -> None:
    with httpx.Client(base_url=server, timeout=10) as client:
        events = client.get("/api/v1/events", params={"open": "true"}).json()["items"]
        by_kind = {(e["hostname"], e["kind"], e["reason"]): e for e in events}
        assert by_kind[("gpu-c", "orphaned", "reparented")]["user"] == "carol"
        assert ("gpu-c", "orphaned", "dead_pid") in by_kind
        assert by_kind[("gpu-b", "idle", "idle")]["user"] == "alice"
        assert by_kind[("gpu-a", "runaway", "leak")]["user"] == "erin"
        assert ("gpu-a", "filling_up", "filling_up") in by_kind

        alerts = client.get("/api/v1/alerts", params={"state": "firing"}).json()
        filling = [a for a in alerts if a["rule"] == "gpu_filling_up_warning"]
        assert filling and filling[0]["labels"]["hostname"] == "gpu-a"
        assert {a["rule"] for a in alerts} >= {"orphaned_memory", "runaway_process"}

        # Distinct owners, as the scenarios name them, on every host.
        users = set()
        for host in ("gpu-a", "gpu-b", "gpu-c"):
            detail = client.get(f"/api/v1/hosts/{host}").json()
            assert detail["fake"] and len(detail["gpus"]) == 2
            users |= {p["user"] for g in detail["gpus"] for p in g["processes"]}
        assert users >= {"alice", "bob", "carol", "dave", "erin", "frank"}
        assert not users & {"root", "nobody"}

        page = client.get("/").text
        for word in ("orphaned", "idle holder", "filling up", "runaway"):
            counted = re.search(rf"{word} <b>(\d+)</b>", page)
            assert counted and int(counted.group(1)) >= 1, word
        # Each host card carries its tiles for the page's script (hosts/tiles.py): a
        # tile's open flags are its last figure, a mask in the order of the page's
        # flag classes (o orphaned, i idle holder, f filling up, r runaway, l lost).
        order = re.search(r'<div class="fleet" data-flags="([^"]+)"', page)
        assert order, "no fleet on the page"
        classes = order.group(1).split()
        flags = {
            host: {css for tile in json.loads(html.unescape(tiles))
                   for bit, css in enumerate(classes) if tile[-1] & 1 << bit}
            for host, tiles in re.findall(r'data-h="([^"]+)" data-t="([^"]*)"', page)
        }  # fmt: skip
        assert {"f", "r"} <= flags["gpu-a"], flags
        assert "i" in flags["gpu-b"], flags
        assert "o" in flags["gpu-c"], flags
        assert "alice" in client.get("/hosts/gpu-b").text


def _reap(ready: dict[str, Any], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """The printed reap command; it finds nothing (20) until a whole window was watched."""
    deadline = time.monotonic() + 45
    while True:
        done = subprocess.run(
            ready["reap_argv"], env=env, capture_output=True, text=True, timeout=60, check=False
        )
        if done.returncode != 20 or time.monotonic() > deadline:
            return done
        time.sleep(2)


def test_demo_finds_every_planted_problem_and_stops_only_what_it_started(
    tmp_path: Path, env: dict[str, str]
) -> None:
    # Another run on this host: the same bundled scenario the demo's gpu-b uses, and
    # the one the old demo stopped by name.
    for scenario in ("demo-b", "workstation"):
        subprocess.run(
            [sys.executable, "-m", "gpuwatch", "fake-nvml", "start", scenario],
            env=env, capture_output=True, timeout=60, check=True,
        )  # fmt: skip
    others = {path: _state_pids(path) for path in (tmp_path / "gpuwatch-fake").glob("*.json")}
    assert len(others) == 2

    stderr = (tmp_path / "demo.err").open("w+")
    demo = subprocess.Popen(
        [sys.executable, "-m", "gpuwatch", "demo", "--listen", "127.0.0.1:0",
         "--speed", SPEED, "--duration", "150", "--json"],
        env=env, stdout=subprocess.PIPE, stderr=stderr, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        assert demo.stdout is not None
        next_line = _lines(demo.stdout)
        ready = next_line(120)
        assert ready is not None and ready["event"] == "ready", stderr.read()
        assert [h["hostname"] for h in ready["hosts"]] == ["gpu-a", "gpu-b", "gpu-c"]
        assert len({h["agent_url"] for h in ready["hosts"]}) == 3
        assert "--idle 20s" in ready["reap_command"]  # 60 s at speed 1

        found, notifications = _wait_for_problems(next_line)
        assert all(n["status"] == "firing" for n in notifications)
        _check_api_and_page(ready["server_url"])

        notebook = next(f["pid"] for f in found if f["kind"] == "idle" and f["user"] == "alice")
        reaped = _reap(ready, env)
        assert reaped.returncode == 0, reaped.stdout + reaped.stderr
        assert not _alive(notebook)
        events = httpx.get(f"{ready['server_url']}/api/v1/events", params={"kind": "reaped"})
        assert [e["pid"] for e in events.json()["items"]] == [notebook]

        demo.send_signal(signal.SIGINT)  # Ctrl-C
        rest = [line for line in iter(lambda: next_line(60), None)]
        assert demo.wait(timeout=60) == 0
    finally:
        if demo.poll() is None:
            os.killpg(demo.pid, signal.SIGKILL)
            demo.wait()
    stopped = rest[-1]
    assert stopped["event"] == "stopped" and stopped["reason"] == "signal"
    assert stopped["totals"]["reaped"] == 1 and stopped["totals"]["notifications_rejected"] == 0
    stderr.seek(0)
    log = stderr.read()
    assert "orphaned/reparented" in log and "orphaned/dead_pid" in log

    # The demo's stand-ins and state files are gone; the other run's are untouched.
    for host in ready["hosts"]:
        assert not Path(host["state_file"]).exists()
        assert not Path(host["state_file"]).with_suffix(".lock").exists()  # nor its lock
        assert not [pid for pid in host["standin_pids"] if _alive(pid)], host["hostname"]
    for path, pids in others.items():
        assert path.exists() and all(_alive(pid) for pid in pids), path.name
