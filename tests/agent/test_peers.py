"""`gpuwatch status --json` agrees with unmodified gpustat and nvitop on the same fake GPUs.

All three run as separate programs under `gpuwatch fake-nvml exec` with scenario time
frozen one hour in, so every figure must match exactly. gpuwatch itself runs there as
any third-party program would: plain `gpuwatch status`, no `--fake-gpus`.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuwatch.nvml.fake.lifecycle import stop_all

MIB = 2**20

NVITOP_VIEW = textwrap.dedent(
    """
    import json
    from nvitop import Device
    print(json.dumps({
        d.uuid(): {"total": d.memory_total(), "used": d.memory_used(),
                   "pids": sorted(d.processes())}
        for d in Device.all()
    }))
    """
)


@pytest.fixture
def runtime_dir(tmp_path: Path) -> Iterator[Path]:
    directory = tmp_path / "runtime"
    yield directory
    stop_all(directory)


def _under_fake(runtime_dir: Path, *command: str) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "gpuwatch", "fake-nvml", "exec", "--runtime-dir", str(runtime_dir),
         "--at", "1h", "workstation", "--", *command],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_status_gpustat_and_nvitop_agree(runtime_dir: Path) -> None:
    ours = json.loads(
        _under_fake(runtime_dir, sys.executable, "-m", "gpuwatch", "status", "--json")
    )
    gpustat = json.loads(_under_fake(runtime_dir, sys.executable, "-m", "gpustat", "--json"))
    nvitop = json.loads(_under_fake(runtime_dir, sys.executable, "-c", NVITOP_VIEW))

    assert [g["uuid"] for g in ours["gpus"]] == [g["uuid"] for g in gpustat["gpus"]] == list(nvitop)
    for our_gpu, their_gpu in zip(ours["gpus"], gpustat["gpus"], strict=True):
        uuid = our_gpu["uuid"]
        assert our_gpu["name"] == their_gpu["name"]
        assert our_gpu["memory_total_bytes"] // MIB == their_gpu["memory.total"]
        assert our_gpu["memory_used_bytes"] // MIB == their_gpu["memory.used"]
        assert our_gpu["memory_total_bytes"] == nvitop[uuid]["total"]
        assert our_gpu["memory_used_bytes"] == nvitop[uuid]["used"]
        our_pids = {p["pid"]: p for p in our_gpu["processes"]}
        assert sorted(our_pids) == nvitop[uuid]["pids"]  # nvitop lists dead PIDs too
        # gpustat drops PIDs psutil cannot find; gpuwatch keeps them and flags them dead.
        live = {pid for pid, p in our_pids.items() if p["alive"]}
        assert {p["pid"] for p in their_gpu["processes"]} == live
        for theirs in their_gpu["processes"]:
            assert our_pids[theirs["pid"]]["used_bytes"] // MIB == theirs["gpu_memory_usage"]
    dead = [p for g in ours["gpus"] for p in g["processes"] if not p["alive"]]
    assert [p["pid"] for p in dead] == [4100001]
