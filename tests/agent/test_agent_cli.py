"""`gpuwatch agent` and `gpuwatch status` as a user runs them: real processes, real HTTP."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gpuwatch.agent.exporter import OOM_POSTS_BURST
from gpuwatch.nvml.fake.lifecycle import stop_all
from gpuwatch.nvml.fake.runtime_state import default_runtime_dir
from gpuwatch.wire import INCIDENTS_OOM_PATH

GiB = 2**30
GPUWATCH = [sys.executable, "-m", "gpuwatch"]

SCENARIO = """
[fake]
name = "cli-test"

[[gpu]]
name = "NVIDIA H100 80GB HBM3"
memory_total = "80GiB"
reserved = "512MiB"

[[gpu]]
name = "NVIDIA H100 80GB HBM3"
memory_total = "80GiB"

[[process]]
gpu = 0
spawn = ["python", "-m", "ipykernel_launcher", "-f", "/tmp/kernel-test.json"]
memory = "20GiB"
sm_percent = 0

[[process]]
gpu = 1
spawn = ["python", "eval.py"]
orphan = true
memory = "9GiB"
sm_percent = 30
"""


@pytest.fixture
def env(tmp_path: Path) -> Iterator[dict[str, str]]:
    """A private fake-GPU runtime dir, so stand-ins never leak between tests."""
    environ = {
        **os.environ,
        "XDG_RUNTIME_DIR": str(tmp_path / "run"),
        "GPUWATCH_CONFIG": "/dev/null",
    }
    (tmp_path / "run").mkdir()
    yield environ
    # What `gpuwatch fake-nvml stop --all` does, without starting a process for it.
    runtime = default_runtime_dir(environ)
    if runtime.exists():
        stop_all(runtime)


@pytest.fixture
def scenario(tmp_path: Path) -> Path:
    path = tmp_path / "cli-test.toml"
    path.write_text(SCENARIO)
    return path


def run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*GPUWATCH, *args], env=env, capture_output=True, text=True, timeout=120)


def test_status_json_reports_gpus_holders_and_flags(env, scenario) -> None:
    result = run(["status", "--fake-gpus", str(scenario), "--json"], env)
    assert result.returncode == 0, result.stderr
    snap = json.loads(result.stdout)
    assert [g["memory_total_bytes"] for g in snap["gpus"]] == [80 * GiB, 80 * GiB]
    kernel = snap["gpus"][0]["processes"][0]
    assert kernel["used_bytes"] == 20 * GiB and kernel["jupyter_kernel"] is True
    assert "ipykernel_launcher" in kernel["command"]
    orphan = snap["gpus"][1]["processes"][0]
    assert orphan["orphaned"] is True and orphan["used_bytes"] == 9 * GiB
    assert snap["fake"] is True


def test_killed_process_frees_its_memory(env, scenario) -> None:
    first = json.loads(run(["status", "--fake-gpus", str(scenario), "--json"], env).stdout)
    pid = first["gpus"][0]["processes"][0]["pid"]
    used_before = first["gpus"][0]["memory_used_bytes"]
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and Path(f"/proc/{pid}").exists():
        time.sleep(0.05)
    second = json.loads(run(["status", "--fake-gpus", str(scenario), "--json"], env).stdout)
    assert second["gpus"][0]["processes"] == []
    assert second["gpus"][0]["memory_used_bytes"] == used_before - 20 * GiB


def test_no_gpu_and_no_scenario_is_one_line_and_exit_4(env) -> None:
    result = run(["status"], env)
    assert result.returncode == 4
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert "--fake-gpus" in result.stderr


def test_bad_scenario_is_one_line_and_exit_3(env, tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('[[gpu]]\nname = "x"\nmemory_total = "lots"\n')
    result = run(["status", "--fake-gpus", str(bad)], env)
    assert result.returncode == 3, result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert "bad.toml" in result.stderr


def test_bad_listen_address_is_exit_3(env) -> None:
    result = run(["agent", "--fake-gpus", "workstation", "--listen", "nowhere"], env)
    assert result.returncode == 3
    assert "listen" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize("interval", ["0", "0.01", "1e-9", "3601"])
def test_a_poll_interval_outside_its_bounds_is_one_line_and_exit_3(env, interval: str) -> None:
    # 0.01 s would poll NVML a hundred times a second: a core spent re-reading samples.
    result = run(["agent", "--fake-gpus", "workstation", "--poll-interval", interval], env)
    assert result.returncode == 3, result.stderr
    assert result.stderr.count("\n") == 1 and "poll_interval_seconds" in result.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["agent", "--bogus"], "No such option: --bogus"),
        (["agent", "--listen"], "Option '--listen' requires an argument."),
    ],
)
def test_agent_usage_errors_are_exit_2_without_a_traceback(
    env: dict[str, str], args: list[str], message: str
) -> None:
    # The agent reads its options without typer, and leaves these to typer to report.
    result = run(args, env)
    assert result.returncode == 2
    assert message in result.stderr and "Traceback" not in result.stderr


def test_agent_help_lists_its_options(env: dict[str, str]) -> None:
    result = run(["agent", "--help"], {**env, "COLUMNS": "200"})
    assert result.returncode == 0
    assert "--poll-interval" in result.stdout and "--no-collector.processes" in result.stdout


def test_version() -> None:
    from gpuwatch import __version__

    result = subprocess.run([*GPUWATCH, "--version"], capture_output=True, text=True, timeout=60)
    assert result.stdout.strip() == f"gpuwatch {__version__}"


def test_agent_serves_metrics_and_stops_cleanly_on_sigterm(env, scenario) -> None:
    agent = subprocess.Popen(
        [
            *GPUWATCH,
            "agent",
            "--fake-gpus",
            str(scenario),
            "--listen",
            "127.0.0.1:0",
            "--poll-interval",
            "0.2",
        ],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert agent.stderr is not None
        line = agent.stderr.readline()
        assert "serving http://127.0.0.1:" in line, line
        url = line.split("serving ", 1)[1].strip().removesuffix("/metrics")
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if httpx.get(f"{url}/healthz").status_code == 200:
                break
            time.sleep(0.1)
        text = httpx.get(f"{url}/metrics").text
        assert 'gpuwatch_gpu_memory_total_bytes{gpu="0",uuid="GPU-' in text
        assert "gpuwatch_gpu_memory_orphaned_bytes" in text
        snap = httpx.get(f"{url}/snapshot").json()
        assert snap["gpus"][1]["processes"][0]["orphaned"] is True
        # A local user's OOM incidents past the per-poster burst are refused, and counted.
        incident = {"pid": 1, "message": "CUDA out of memory"}
        answers = [
            httpx.post(f"{url}{INCIDENTS_OOM_PATH}", json=incident).status_code
            for _ in range(int(OOM_POSTS_BURST) + 2)
        ]
        assert answers.count(429) == 2, answers
        assert "gpuwatch_agent_oom_posts_refused_total 2.0" in httpx.get(f"{url}/metrics").text
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(timeout=20) == 0
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()


def _fake_states(env: dict[str, str]) -> list[Path]:
    """Scenario state files in the private runtime dir: one per booted scenario."""
    return sorted((Path(env["XDG_RUNTIME_DIR"]) / "gpuwatch-fake").glob("*.json"))


def test_busy_listen_port_is_one_line_exit_3_and_boots_nothing(env, scenario) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run(["agent", "--fake-gpus", str(scenario), "--listen", f"127.0.0.1:{port}"], env)
    assert result.returncode == 3, result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in result.stderr
    assert "serving" not in result.stderr
    assert _fake_states(env) == []  # no stand-ins were started, so none are left


def test_bind_failure_after_boot_stops_the_standins_it_booted(env, scenario) -> None:
    # The race the pre-check cannot close: the port is taken between check and bind.
    script = (
        "import sys\n"
        "from gpuwatch.cli.agent import _build\n"
        "from gpuwatch.errors import ConfigError\n"
        "from gpuwatch.settings import AgentSettings\n"
        "s = AgentSettings(fake_gpus=sys.argv[1], listen='127.0.0.1:' + sys.argv[2])\n"
        "try:\n    _build(s)\nexcept ConfigError as err:\n    print(err)\n    sys.exit(3)\n"
    )
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-c", script, str(scenario), str(port)],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert result.returncode == 3, result.stderr
    assert "cannot listen" in result.stdout
    assert _fake_states(env) == []


def test_server_without_token_is_refused_at_start(env) -> None:
    started = time.monotonic()
    result = run(
        ["agent", "--fake-gpus", "workstation", "--listen", "127.0.0.1:0", "--server",
         "http://127.0.0.1:9"],
        {k: v for k, v in env.items() if k != "GPUWATCH_AGENT_TOKEN"},
    )  # fmt: skip
    assert result.returncode == 3
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert "needs a token" in result.stderr and "GPUWATCH_AGENT_TOKEN" in result.stderr
    assert time.monotonic() - started < 60
    assert _fake_states(env) == []
