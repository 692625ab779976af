"""Agent benchmark: 8 GPUs x 200 processes on the fake GPUs beneath pynvml.

Reported, each as a ratio to a baseline measured side by side in the same run:

* poll: one full ``Sampler.poll()`` (NVML reads + /proc attribution + snapshot) vs
  (a) the bare pynvml calls that poll needs, made in a plain loop (the limit), and
  (b) gpustat's ``new_query()`` on the same fake (a peer).
  Targets: <= 1.5x the bare calls, <= 0.3x gpustat.
* scrape: ``GET /metrics`` of a running agent (per-process series on) vs
  ``GET /metrics`` of Debian's prometheus-node-exporter on the same machine, both over
  loopback HTTP. Target: no slower than node_exporter.
* memory: the agent process's RSS after start-up, its growth over 10,000 scrapes, and
  over the 10,000 after those (steady state, past the allocator's warm-up).
  Targets: <= 40 MiB, no growth.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from bench.common import interleaved, terminate, write_result

ROOT = Path(__file__).resolve().parent.parent

SCENARIO = "big"
SCRAPES = 10_000


Call = tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]


def _calls_of(pynvml: Any, poll: Callable[[], Any]) -> list[Call]:
    """Every pynvml function one ``poll()`` calls, with its arguments, in order: the
    baseline is exactly what the poll asks NVML, however the poll grows (a list kept by
    hand went stale as health and profiling reads were added, and the ratio with it).

    The functions are wrapped only while this one untimed poll runs, and each wrapper
    calls the real function (the fake library stays beneath pynvml). Calls pynvml makes
    to its own helpers from inside another call are not recorded: replaying the outer
    call makes them again.
    """
    recorded: list[Call] = []
    inside = threading.local()  # the poll reads each GPU on a worker thread
    originals = {
        name: function
        for name, function in vars(pynvml).items()
        if name.startswith("nvml") and name[4:5].isupper() and inspect.isfunction(function)
    }

    def spy(function: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            outer = not getattr(inside, "depth", 0)
            if outer:
                recorded.append((function, args, kwargs))
            inside.depth = getattr(inside, "depth", 0) + 1
            try:
                return function(*args, **kwargs)
            finally:
                inside.depth -= 1

        return call

    for name, function in originals.items():
        setattr(pynvml, name, spy(function))
    try:
        poll()
    finally:
        for name, function in originals.items():
            setattr(pynvml, name, function)
    return recorded


def _bare_calls(pynvml: Any, calls: list[Call]) -> None:
    """The recorded calls with nothing around them: no reading of the results, no
    attribution, no snapshot. An error is what the poll met too (NOT_FOUND: no new
    samples; NOT_SUPPORTED), so it is let pass."""
    for function, args, kwargs in calls:
        with contextlib.suppress(pynvml.NVMLError):
            function(*args, **kwargs)


def _gpustat_seconds(runtime_dir: Path, *, repeat: int, number: int) -> dict[str, Any]:
    """gpustat's ``new_query()`` on the same fake GPUs, in its own process."""
    env = {**os.environ, "XDG_RUNTIME_DIR": str(runtime_dir), "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-m", "gpuwatch", "fake-nvml", "exec", SCENARIO, "--",
         sys.executable, "-m", "bench.gpustat_probe", str(repeat), str(number)],
        env=env, capture_output=True, text=True, timeout=600, check=True,
    )  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def bench_poll(runtime_dir: Path) -> dict[str, Any]:
    import pynvml

    from gpuwatch.agent.assemble import build_sampler
    from gpuwatch.agent.state import AgentState
    from gpuwatch.nvml import fake
    from gpuwatch.settings import AgentSettings

    host = fake.install(SCENARIO, runtime_dir=runtime_dir / "gpuwatch-fake")
    try:
        settings = AgentSettings(fake_gpus=None)
        sampler = build_sampler(settings, AgentState())  # fake already beneath pynvml
        gpus = pynvml.nvmlDeviceGetCount()
        processes = sum(len(g.processes) for g in sampler.poll().gpus)
        calls = _calls_of(pynvml, sampler.poll)
        times = interleaved(
            {"bare_pynvml": lambda: _bare_calls(pynvml, calls), "gpuwatch_poll": sampler.poll},
            repeat=7,
            number=5,
        )
        peer = _gpustat_seconds(runtime_dir, repeat=7, number=5)
        times["gpustat_query"] = peer["seconds"]
    finally:
        fake.uninstall()
        host.stop()
    return {
        "gpus": gpus,
        "processes": processes,
        "nvml_calls_per_poll": len(calls),
        "gpustat_saw": {"gpus": peer["gpus"], "processes": peer["processes"]},
        "seconds": times,
        "ratio_poll_to_bare": times["gpuwatch_poll"] / times["bare_pynvml"],
        "ratio_poll_to_gpustat": times["gpuwatch_poll"] / times["gpustat_query"],
        "targets": {"ratio_poll_to_bare": 1.5, "ratio_poll_to_gpustat": 0.3},
    }


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait_http(url: str, deadline_s: float = 120.0) -> None:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not come up")


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def _import_floor_rss() -> int:
    """RSS of a Python that only imports what the agent imports: the part no poll or
    scrape adds, to read the agent's own RSS against."""
    # What `gpuwatch agent` imports: only its own command registered (gpuwatch.cli
    # registers the others' modules for other commands only).
    probe = (
        "import re, gpuwatch.cli, gpuwatch.agent.assemble, gpuwatch.agent.push, "
        "gpuwatch.nvml.fake.library; "
        "gpuwatch.cli._register_for(['agent']); "
        "print(re.search(r'VmRSS:\\s+(\\d+)', open('/proc/self/status').read()).group(1))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    return int(out.stdout.strip()) * 1024


def bench_scrape_and_memory(runtime_dir: Path) -> dict[str, Any]:
    env = {**os.environ, "XDG_RUNTIME_DIR": str(runtime_dir), "GPUWATCH_CONFIG": "/dev/null"}
    port = _free_port()
    agent = subprocess.Popen(
        [sys.executable, "-m", "gpuwatch", "agent", "--fake-gpus", SCENARIO,
         "--listen", f"127.0.0.1:{port}", "--collector.processes"],
        env=env, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    node_exporter = None
    result: dict[str, Any] = {}
    try:
        agent_url = f"http://127.0.0.1:{port}"
        _wait_http(f"{agent_url}/healthz")
        subjects = {}
        with httpx.Client() as client:
            subjects["gpuwatch_scrape"] = lambda: client.get(f"{agent_url}/metrics").content
            binary = shutil.which("prometheus-node-exporter") or shutil.which("node_exporter")
            if binary:
                ne_port = _free_port()
                node_exporter = subprocess.Popen(
                    [binary, f"--web.listen-address=127.0.0.1:{ne_port}"],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                )  # fmt: skip
                _wait_http(f"http://127.0.0.1:{ne_port}/metrics")
                subjects["node_exporter_scrape"] = lambda: (
                    client.get(f"http://127.0.0.1:{ne_port}/metrics").content
                )
            body = client.get(f"{agent_url}/metrics").content
            times = interleaved(subjects, repeat=7, number=20)
            result["scrape_seconds"] = times
            result["gpuwatch_scrape_bytes"] = len(body)
            if "node_exporter_scrape" in times:
                result["ratio_scrape_to_node_exporter"] = (
                    times["gpuwatch_scrape"] / times["node_exporter_scrape"]
                )
            rss_start = _rss_bytes(agent.pid)
            for _ in range(SCRAPES):
                client.get(f"{agent_url}/metrics")
            rss_end = _rss_bytes(agent.pid)
            # Then 10,000 more: the first run includes the allocator's warm-up (arenas and
            # pools reaching their working size); a leak keeps growing in the second.
            for _ in range(SCRAPES):
                client.get(f"{agent_url}/metrics")
            rss_steady_end = _rss_bytes(agent.pid)
        result["rss_import_floor_bytes"] = _import_floor_rss()
        result["rss_after_start_bytes"] = rss_start
        result["rss_after_scrapes_bytes"] = rss_end
        result["rss_growth_bytes"] = rss_end - rss_start
        result["rss_growth_next_scrapes_bytes"] = rss_steady_end - rss_end
        result["scrapes"] = SCRAPES
        result["targets"] = {
            "ratio_scrape_to_node_exporter": 1.0,
            "rss_bytes": 40 * 2**20,
            "rss_growth_bytes": 0,
            "rss_growth_next_scrapes_bytes": 0,
        }
    finally:
        for proc in (agent, node_exporter):
            if proc is not None:
                terminate(proc, grace_seconds=20)
        subprocess.run(
            [sys.executable, "-m", "gpuwatch", "fake-nvml", "stop", "--all"],
            env=env, capture_output=True, timeout=60, check=False,
        )  # fmt: skip
    return result


def main() -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="gpuwatch-bench-") as tmp:
        runtime = Path(tmp)
        result = {
            "poll": bench_poll(runtime / "poll"),
            "scrape": bench_scrape_and_memory(runtime / "agent"),
        }
    path = write_result("agent", result)
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
