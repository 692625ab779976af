"""`gpuwatch fake-nvml exec`: other programs, unmodified, see the same fake GPUs as we do.

Acceptance: gpustat and nvitop, run as they ship, report the GPUs, memory and PIDs that
pynvml reports in this process through the same scenario. Scenario time is frozen
(``--at``) on both sides, so every figure must match exactly.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from gpuwatch.nvml import fake

MIB = 2**20
AT_SECONDS = 3600  # one hour in: the training run has finished warming up

# What pynvml sees, as JSON-able data: the same source runs in-process and under `exec`.
PYNVML_VIEW = textwrap.dedent(
    """
    import json, pynvml

    def view():
        pynvml.nvmlInit()
        gpus = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(index)
            memory = pynvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2)
            procs = pynvml.nvmlDeviceGetComputeRunningProcesses(h) + pynvml.nvmlDeviceGetGraphicsRunningProcesses(h)
            gpus.append({
                "uuid": pynvml.nvmlDeviceGetUUID(h),
                "name": pynvml.nvmlDeviceGetName(h),
                "total": memory.total,
                "used": memory.used,
                "processes": {str(p.pid): p.usedGpuMemory for p in procs},
            })
        pynvml.nvmlShutdown()
        return gpus
    """
)
PRINT_PYNVML_VIEW = PYNVML_VIEW + "print(json.dumps(view()))\n"

NVITOP_VIEW = textwrap.dedent(
    """
    import json
    from nvitop import Device
    print(json.dumps([
        {
            "uuid": d.uuid(),
            "name": d.name(),
            "total": d.memory_total(),
            "used": d.memory_used(),
            "processes": {str(pid): p.gpu_memory() for pid, p in d.processes().items()},
        }
        for d in Device.all()
    ]))
    """
)


def in_process_view() -> list[dict[str, object]]:
    namespace: dict[str, object] = {}
    exec(compile(PYNVML_VIEW, "pynvml_view", "exec"), namespace)
    return namespace["view"]()  # type: ignore[operator,no-any-return]


@pytest.fixture
def workstation(runtime_dir: Path) -> fake.FakeHost:
    return fake.install("workstation", runtime_dir=runtime_dir, at=AT_SECONDS)


def exec_under(
    runtime_dir: Path, *command: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    cli = [sys.executable, "-m", "gpuwatch", "fake-nvml", "exec", "--runtime-dir", str(runtime_dir)]
    return subprocess.run(
        [*cli, "--at", "1h", "workstation", "--", *command],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )


def test_a_second_process_sees_the_same_pids_and_memory(
    workstation: fake.FakeHost, runtime_dir: Path
) -> None:
    ours = in_process_view()
    result = exec_under(runtime_dir, sys.executable, "-c", PRINT_PYNVML_VIEW)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == ours
    pids = {int(pid) for gpu in ours for pid in gpu["processes"]}  # type: ignore[attr-defined]
    assert set(workstation.pids.values()) <= pids
    assert 4100001 in pids  # the ghost


def test_gpustat_json_shows_the_same_gpus_memory_and_pids(
    workstation: fake.FakeHost, runtime_dir: Path
) -> None:
    ours = in_process_view()
    result = exec_under(runtime_dir, sys.executable, "-m", "gpustat", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["driver_version"] == "550.54.15"
    assert [g["uuid"] for g in report["gpus"]] == [g["uuid"] for g in ours]
    for gpustat_gpu, our_gpu in zip(report["gpus"], ours, strict=True):
        assert gpustat_gpu["name"] == our_gpu["name"]
        assert gpustat_gpu["memory.total"] == our_gpu["total"] // MIB  # type: ignore[operator]
        assert gpustat_gpu["memory.used"] == our_gpu["used"] // MIB  # type: ignore[operator]
        # gpustat drops PIDs psutil cannot find (the ghost): compare the live ones.
        alive = {
            int(pid): used
            for pid, used in our_gpu["processes"].items()
            if psutil.pid_exists(int(pid))
        }  # type: ignore[attr-defined]
        assert {p["pid"]: p["gpu_memory_usage"] for p in gpustat_gpu["processes"]} == {
            pid: used // MIB for pid, used in alive.items()
        }
    commands = {p["pid"]: p["full_command"] for g in report["gpus"] for p in g["processes"]}
    kernel = workstation.pids["0.0"]
    assert commands[kernel][:3] == ["python", "-m", "ipykernel_launcher"]


def test_nvitop_shows_the_same_gpus_memory_and_pids(
    workstation: fake.FakeHost, runtime_dir: Path
) -> None:
    ours = in_process_view()
    result = exec_under(runtime_dir, sys.executable, "-c", NVITOP_VIEW)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == ours  # nvitop lists the ghost too
    screen = exec_under(runtime_dir, sys.executable, "-m", "nvitop", "--once", "--only-compute")
    assert screen.returncode == 0, screen.stderr
    assert "RTX A6000" in screen.stdout
    for pid in (workstation.pids["0.0"], workstation.pids["1.0"], 4100001):
        assert str(pid) in screen.stdout
    assert "Traceback" not in screen.stderr


def test_exec_passes_the_exit_code_and_leaves_other_programs_alone(
    workstation: fake.FakeHost, runtime_dir: Path
) -> None:
    result = exec_under(
        runtime_dir, sys.executable, "-c", "import sys; print('pynvml' in sys.modules); sys.exit(7)"
    )
    assert (result.returncode, result.stdout.strip(), result.stderr) == (7, "False", "")
    missing = exec_under(runtime_dir, "no-such-program-gpuwatch")
    assert missing.returncode == 127
    assert (
        missing.stderr.strip()
        == "gpuwatch: error: cannot run no-such-program-gpuwatch: No such file or directory"
    )


def test_an_existing_sitecustomize_still_runs(
    workstation: fake.FakeHost, runtime_dir: Path, tmp_path: Path
) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "sitecustomize.py").write_text(
        "import builtins\nbuiltins.THEIR_SITECUSTOMIZE = True\n"
    )
    env = {**os.environ, "PYTHONPATH": str(theirs)}
    code = "import builtins, pynvml; pynvml.nvmlInit(); print(builtins.THEIR_SITECUSTOMIZE, pynvml.nvmlDeviceGetCount())"
    result = exec_under(runtime_dir, sys.executable, "-c", code, env=env)
    assert (result.returncode, result.stdout.strip()) == (0, "True 4"), result.stderr


def test_start_and_stop_from_the_cli(
    runtime_dir: Path, gpuwatch_cli: Callable[..., subprocess.CompletedProcess[str]]
) -> None:
    started = gpuwatch_cli("fake-nvml", "start", "--runtime-dir", str(runtime_dir), "workstation")
    assert started.returncode == 0, started.stderr
    rows = [line.split("\t") for line in started.stdout.splitlines() if not line.startswith("#")]
    assert [(gpu, command.split()[0]) for _, gpu, command in rows] == [
        ("0", "python"),
        ("1", "python"),
        ("3", "python"),
        ("3", "/usr/lib/xorg/Xorg"),
    ]
    pids = [int(pid) for pid, _, _ in rows]
    assert all(psutil.pid_exists(pid) for pid in pids)
    host = fake.install("workstation", runtime_dir=runtime_dir)  # the same boot
    assert sorted(host.pids.values()) == sorted(pids)
    stopped = gpuwatch_cli("fake-nvml", "stop", "--runtime-dir", str(runtime_dir), "workstation")
    assert stopped.returncode == 0 and stopped.stdout.startswith("stopped 5 processes")
    assert not any(
        psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie" for pid in pids
    )
