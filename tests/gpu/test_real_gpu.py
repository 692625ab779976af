"""Smoke tests on a real NVIDIA GPU (marker ``gpu``; skipped where there is no driver).

Run on a GPU host with ``.venv/bin/pytest -m gpu tests/gpu -q`` (a minute or two).
They check what the fake GPUs cannot: that real NVML agrees with CUDA, and that a CUDA
process the test starts shows up with its memory and its owner.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from gpuwatch.agent.assemble import build_sampler
from gpuwatch.agent.state import AgentState
from gpuwatch.nvml.library import NvmlSession
from gpuwatch.settings import AgentSettings

pytestmark = pytest.mark.gpu

# Allocates 1 GiB on GPU 0, says so, then waits to be killed.
_HOLDER = """
import sys, time, torch
x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda:0")
torch.cuda.synchronize()
print("ready", flush=True)
time.sleep(600)
"""


def test_nvml_initialises_and_lists_gpus() -> None:
    with NvmlSession.open() as session:
        assert session.device_count() >= 1
        reading = session.read_device(0)
        assert reading.uuid.startswith(("GPU-", "MIG-"))
        assert reading.memory_total_bytes and reading.memory_total_bytes > 2**30


def test_memory_matches_cuda_within_one_percent() -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here")
    free, total = torch.cuda.mem_get_info(0)
    with NvmlSession.open() as session:
        reading = session.read_device(0)
    assert reading.memory_total_bytes is not None and reading.memory_free_bytes is not None
    # NVML's v2 total includes the driver's reserved memory; CUDA's does not.
    nvml_total = reading.memory_total_bytes - (reading.memory_reserved_bytes or 0)
    assert (
        abs(nvml_total - total) / total < 0.01
        or abs(reading.memory_total_bytes - total) / total < 0.01
    )
    assert abs(reading.memory_free_bytes - free) / total < 0.01


def test_cuda_process_appears_with_memory_and_owner() -> None:
    pytest.importorskip("torch")
    child = subprocess.Popen([sys.executable, "-c", _HOLDER], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        sampler = build_sampler(AgentSettings(), AgentState())
        deadline = time.monotonic() + 30
        proc = None
        while time.monotonic() < deadline and proc is None:
            snapshot = sampler.poll()
            proc = next((p for g in snapshot.gpus for p in g.processes if p.pid == child.pid), None)
        if proc is None and snapshot.pid_namespace_isolated:
            pytest.skip("agent runs in a PID namespace: NVML's host PIDs are not visible")
        assert proc is not None, "the CUDA process never appeared in NVML's process list"
        assert proc.used_bytes is None or proc.used_bytes >= 2**30
        assert proc.owner.uid == os.getuid()
        assert "python" in (proc.command or "")
    finally:
        child.kill()
        child.wait(timeout=30)
