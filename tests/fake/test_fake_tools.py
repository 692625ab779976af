"""Every bundled scenario, through unmodified third-party tools: the fake is faithful enough
that ``nvitop --once``, ``gpustat --json`` and ``nvitop-exporter`` run on it without an
error, and they agree with ``gpuwatch status --json`` on each GPU's memory and on the PIDs
that hold it.

All four run under ``gpuwatch fake-nvml exec --at 1h``, so they read the same frozen
moment (the ``gpu-lost`` GPU is gone by then: every tool must say so, not crash).
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from gpuwatch.nvml.fake import bundled_scenario_names

MIB = 2**20
AT = "1h"

pytest.importorskip("nvitop_exporter", reason="nvitop-exporter is in the dev extra")


def _exec(runtime_dir: Path, scenario: str, *command: str) -> list[str]:
    return [
        sys.executable, "-m", "gpuwatch", "fake-nvml", "exec", "--runtime-dir", str(runtime_dir),
        "--at", AT, scenario, "--", *command,
    ]  # fmt: skip


def _run(runtime_dir: Path, scenario: str, *command: str) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        _exec(runtime_dir, scenario, *command),
        capture_output=True,
        text=True,
        timeout=120,
        env=_env(),
    )
    assert result.returncode == 0, f"{command}: exit {result.returncode}\n{result.stderr}"
    assert "Traceback" not in result.stderr, result.stderr
    return result


def _env() -> dict[str, str]:
    return {**os.environ, "GPUWATCH_CONFIG": "/dev/null"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _readable(status: dict[str, Any]) -> dict[int, dict[str, Any]]:
    return {g["index"]: g for g in status["gpus"] if not g["lost"] and not g["read_error"]}


def _live_pids(gpu: dict[str, Any]) -> set[int]:
    """PIDs that exist: tools built on psutil drop the others (ghosts)."""
    return {p["pid"] for p in gpu["processes"] if p["alive"] and p["visible"]}


def _exporter_metrics(
    runtime_dir: Path, scenario: str, complete: Callable[[str], bool]
) -> tuple[str, str]:
    """Run nvitop-exporter until ``complete`` holds for its metrics page; that page and its log.

    The exporter updates its series one GPU at a time, so a scrape can land halfway through a
    pass (the last GPU's memory exported, its processes not yet): wait for a whole pass rather
    than for the first page that names every GPU. Past the deadline, the last page comes back
    and the caller's assertions say what is missing.
    """
    port = _free_port()
    log = runtime_dir.parent / f"nvitop-exporter-{scenario}.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            _exec(runtime_dir, scenario, sys.executable, "-m", "nvitop_exporter",
                  "--bind-address", "127.0.0.1", "--port", str(port)),
            stdout=out, stderr=subprocess.STDOUT, env=_env(),
        )  # fmt: skip
    try:
        text = ""
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert proc.poll() is None, f"nvitop-exporter exited:\n{log.read_text()}"
            try:
                text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
            except httpx.HTTPError:
                text = ""
            if complete(text):
                break
            time.sleep(0.2)
        return text, log.read_text()
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _exported(text: str) -> tuple[dict[int, float], dict[int, float], dict[int, set[int]]]:
    """Per physical GPU index: memory used (MiB), memory total (MiB), and the PIDs with series."""
    used = {int(labels["index"]): value for labels, value in _samples(text, "gpu_memory_used_MiB")
            if labels["index"].isdigit()}  # fmt: skip
    total = {int(labels["index"]): value for labels, value in _samples(text, "gpu_memory_total_MiB")
             if labels["index"].isdigit()}  # fmt: skip
    pids: dict[int, set[int]] = {}
    for labels, _ in _samples(text, "process_gpu_memory_MiB"):
        if labels["index"].isdigit():
            pids.setdefault(int(labels["index"]), set()).add(int(labels["pid"]))
    return used, total, pids


def _samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    found = []
    for labels, value in re.findall(rf"^{name}\{{([^}}]*)\}} (\S+)$", text, re.M):
        found.append((dict(re.findall(r'(\w+)="([^"]*)"', labels)), float(value)))
    return found


@pytest.mark.parametrize("scenario", bundled_scenario_names())
def test_third_party_tools_run_and_agree_with_gpuwatch(scenario: str, runtime_dir: Path) -> None:
    status = json.loads(_run(runtime_dir, scenario, sys.executable, "-m", "gpuwatch", "status",
                             "--json").stdout)  # fmt: skip
    readable = _readable(status)
    assert readable, "every scenario has a GPU to read"

    # gpustat --json: memory in MiB, and the processes psutil can find.
    report = json.loads(
        _run(runtime_dir, scenario, sys.executable, "-m", "gpustat", "--json").stdout
    )
    for gpu in report["gpus"]:
        ours = readable.get(gpu["index"])
        if ours is None:
            continue
        assert gpu["uuid"] == ours["uuid"]
        assert gpu["memory.used"] == ours["memory_used_bytes"] // MIB, gpu["index"]
        assert gpu["memory.total"] == ours["memory_total_bytes"] // MIB, gpu["index"]
        assert {p["pid"] for p in gpu["processes"]} == _live_pids(ours), gpu["index"]
    assert {g["index"] for g in report["gpus"]} >= set(readable)

    # nvitop --once: the whole screen, every process (ghosts included) by PID.
    screen = _run(runtime_dir, scenario, sys.executable, "-m", "nvitop", "--once").stdout
    for gpu in readable.values():
        name = (gpu["name"] or "").removeprefix("NVIDIA ")
        assert name[:12] in screen, name
        for process in gpu["processes"]:
            assert re.search(rf"\b{process['pid']}\b", screen), process["pid"]
    for index in set(g["index"] for g in status["gpus"]) - set(readable):
        assert "GPU is Lost" in screen, index

    # nvitop-exporter: per-GPU memory in MiB and per-process series, for physical GPUs.
    def complete(text: str) -> bool:
        used, total, pids = _exported(text)
        return set(used) & set(total) >= set(readable) and all(
            pids.get(index, set()) >= _live_pids(gpu) for index, gpu in readable.items()
        )

    metrics, log = _exporter_metrics(runtime_dir, scenario, complete)
    assert "Traceback" not in log, log
    problems = [line for line in log.splitlines() if "ERROR" in line and "GPU is Lost" not in line]
    assert not problems, log
    used, total, pids = _exported(metrics)
    for index, gpu in readable.items():
        assert used.get(index) == gpu["memory_used_bytes"] / MIB, index
        assert total.get(index) == gpu["memory_total_bytes"] / MIB, index
        assert pids.get(index, set()) >= _live_pids(gpu), index
