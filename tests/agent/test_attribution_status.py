"""``gpuwatch status`` says when it cannot see an owner, and why, instead of calling a
hidden process dead: the real CLI over fake GPUs whose ghost PIDs live in a fake host
``/proc`` (``GPUWATCH_AGENT_PROC_ROOT``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.fakeproc import make_root, write_process
from gpuwatch.nvml.fake.lifecycle import stop_all
from gpuwatch.nvml.fake.runtime_state import default_runtime_dir

HIDDEN, GONE, SUBUID = 6001, 6002, 6003
SCENARIO = f"""
[fake]
name = "attribution"

[[gpu]]
name = "NVIDIA A100-SXM4-80GB"
memory_total = "80GiB"

[[process]]
gpu = 0
ghost = {HIDDEN}
memory = "30GiB"

[[process]]
gpu = 0
ghost = {GONE}
memory = "2GiB"

[[process]]
gpu = 0
ghost = {SUBUID}
memory = "1GiB"
"""


@pytest.fixture
def env(tmp_path: Path) -> Iterator[dict[str, str]]:
    root = make_root(tmp_path / "proc")
    write_process(root, HIDDEN)
    (root / str(HIDDEN) / "stat").unlink()
    (root / str(HIDDEN) / "stat").mkdir()  # a refused read (EISDIR here; EACCES under hidepid=1)
    write_process(root, SUBUID, uid=0)  # the namespace owner's own process: host uid 1000
    (root / "self").mkdir()
    (root / "self" / "uid_map").write_text("0 1000 1\n")  # a rootless container's
    (tmp_path / "run").mkdir()
    environ = {
        **os.environ,
        "XDG_RUNTIME_DIR": str(tmp_path / "run"),
        "GPUWATCH_CONFIG": "/dev/null",
        "GPUWATCH_AGENT_PROC_ROOT": str(root),
        "COLUMNS": "200",
    }
    yield environ
    runtime = default_runtime_dir(environ)
    if runtime.exists():
        stop_all(runtime)


def status(tmp_path: Path, env: dict[str, str], *flags: str) -> str:
    scenario = tmp_path / "attribution.toml"
    scenario.write_text(SCENARIO)
    result = subprocess.run(
        [sys.executable, "-m", "gpuwatch", "status", "--fake-gpus", str(scenario), *flags],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return result.stdout


def test_status_calls_a_hidden_process_hidden_and_says_why(tmp_path: Path, env) -> None:
    out = status(tmp_path, env)
    lines = {
        pid: next(line for line in out.splitlines() if f" {pid} " in line) for pid in (HIDDEN, GONE)
    }

    assert "hidden by /proc" in lines[HIDDEN] and "DEAD PID" not in lines[HIDDEN]
    assert "DEAD PID" in lines[GONE]
    assert f"held by PID {HIDDEN}" not in out  # never "which no longer exists"
    assert f"held by PID {GONE}, which no longer exists" in out
    assert "this reader runs in a user namespace" in out


def test_status_json_has_the_hidden_process_alive_with_no_owner(tmp_path: Path, env) -> None:
    processes = {
        p["pid"]: p for p in json.loads(status(tmp_path, env, "--json"))["gpus"][0]["processes"]
    }
    hidden, own = processes[HIDDEN], processes[SUBUID]
    assert (hidden["alive"], hidden["visible"], hidden["owner"]["user"]) == (True, False, None)
    assert own["owner"]["uid"] == 1000  # uid 0 in the reader's namespace is host uid 1000
