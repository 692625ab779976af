"""docker-compose.yml and deploy/docker: the demo stack is wired together and locked down."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from support.processes import stop_processes
from support.served_as import free_port

from gpuwatch.nvml.fake.lifecycle import stop_all
from gpuwatch.nvml.fake.runtime_state import default_runtime_dir

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "deploy" / "docker" / "Dockerfile"
GPUWATCH_SERVICES = ("server", "agent")


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    # PyYAML resolves the `<<: *gpuwatch` merge keys as Compose does.
    return yaml.safe_load(COMPOSE.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, Any]:
    return compose["services"]


def _compose_cli() -> list[str] | None:
    if shutil.which("docker"):
        probe = subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=30)
        if probe.returncode == 0:
            return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    return None


def test_docker_compose_config_accepts_the_file() -> None:
    cli = _compose_cli()
    if cli is None:
        pytest.skip("neither the docker compose plugin nor docker-compose is installed")
    result = subprocess.run(
        [*cli, "-f", str(COMPOSE), "config", "-q"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr


def test_the_demo_stack_has_its_four_services(services: dict[str, Any]) -> None:
    assert set(services) == {"server", "agent", "prometheus", "grafana"}


def _unescaped(value: str) -> str:
    """``value`` as Compose hands it to the container: ``$$`` is a literal ``$``. Any
    other ``$`` would be interpolated from the host's environment, which the agent's
    wrapper must not depend on."""
    assert "$" not in value.replace("$$", ""), value
    return value.replace("$$", "$")


def _agent_argv(services: dict[str, Any]) -> list[str]:
    """What the agent container runs: its entrypoint (the image's, `gpuwatch`, unless
    the service sets one), then its command."""
    agent = services["agent"]
    entrypoint = agent.get("entrypoint", ["gpuwatch"])
    return [_unescaped(part) for part in [*entrypoint, *agent["command"]]]


def _agent_environment(services: dict[str, Any], token: str) -> dict[str, str]:
    """The agent service's environment, ``${GPUWATCH_AGENT_TOKEN:-}`` interpolated as
    Compose does with ``token`` in ``.env`` (empty: no ``.env`` yet)."""
    environment = dict(services["agent"]["environment"])
    assert environment["GPUWATCH_AGENT_TOKEN"] == "${GPUWATCH_AGENT_TOKEN:-}"
    environment["GPUWATCH_AGENT_TOKEN"] = token
    return environment


def test_agent_runs_on_simulated_gpus(services: dict[str, Any]) -> None:
    command = services["agent"]["command"]
    assert command[0] == "agent"
    assert "--fake-gpus=workstation" in command


@pytest.mark.parametrize(
    ("token", "server_args"),
    [("s3cret", ["--server=http://server:9403"]), ("", [])],
    ids=["token-pushes", "no-token-metrics-only"],
)
def test_agent_wrapper_passes_the_server_only_with_a_token(
    services: dict[str, Any], tmp_path: Path, token: str, server_args: list[str]
) -> None:
    """The demo's first `docker compose up` has no token: the agent must not be given a
    server then (it would refuse to start, exit 3, and `restart:` would loop it)."""
    fake = tmp_path / "bin" / "gpuwatch"
    fake.parent.mkdir()
    fake.write_text('#!/bin/sh\nprintf "%s\\n" "$@"\n')
    fake.chmod(0o755)
    result = subprocess.run(
        _agent_argv(services),
        capture_output=True,
        text=True,
        timeout=10,
        env={"PATH": f"{fake.parent}:/usr/bin:/bin", **_agent_environment(services, token)},
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [*services["agent"]["command"], *server_args]
    assert ("metrics only" in result.stderr) is (not token)


def test_agent_without_a_token_serves_metrics_instead_of_exiting(
    services: dict[str, Any], tmp_path: Path
) -> None:
    """The real agent, started the way the compose file starts it before `.env` exists
    (the image's environment as the Dockerfile sets it, the listen address aside)."""
    runtime = tmp_path / "run"
    runtime.mkdir()
    port = free_port()
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        "GPUWATCH_CONFIG": "/dev/null",
        "XDG_RUNTIME_DIR": str(runtime),
        "GPUWATCH_AGENT_SPOOL_DIR": str(tmp_path / "spool"),
        **_agent_environment(services, ""),
        "GPUWATCH_AGENT_LISTEN": f"127.0.0.1:{port}",
    }
    agent = subprocess.Popen(
        _agent_argv(services), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    try:
        metrics = _scrape_until_up(
            agent, f"http://127.0.0.1:{port}/metrics", until="gpuwatch_agent_fake_gpus 1.0"
        )
        assert "gpuwatch_agent_fake_gpus 1.0" in metrics
        assert agent.poll() is None
    finally:
        stop_processes([agent])
        stop_all(default_runtime_dir(env))


def _scrape_until_up(process: subprocess.Popen[bytes], url: str, until: str) -> str:
    """The agent's exposition once it holds ``until``: the server answers before the
    first poll has read the GPUs."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if process.poll() is not None:
            stderr = process.stderr.read().decode() if process.stderr else ""
            pytest.fail(f"the agent exited {process.returncode}: {stderr}")
        try:
            response = httpx.get(url, timeout=2)
            if response.status_code == 200 and until in response.text:
                return response.text
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    pytest.fail(f"{url} never answered with {until!r}")


def test_the_demo_scenario_is_bundled() -> None:
    scenarios = ROOT / "gpuwatch" / "nvml" / "fake" / "scenarios"
    assert (scenarios / "workstation.toml").is_file()


@pytest.mark.parametrize("name", GPUWATCH_SERVICES)
def test_gpuwatch_services_use_the_image_built_here_and_are_locked_down(
    services: dict[str, Any], name: str
) -> None:
    service = services[name]
    assert service["build"] == {"context": ".", "dockerfile": "deploy/docker/Dockerfile"}
    assert service["read_only"] is True
    assert service["cap_drop"] == ["ALL"]
    assert "no-new-privileges:true" in service["security_opt"]
    # The image's USER applies only while the service does not override it.
    assert "user" not in service and "privileged" not in service
    assert "healthcheck" in service


def test_published_ports_are_loopback_only(services: dict[str, Any]) -> None:
    """Nothing in the demo authenticates, so nothing may face the network."""
    for name, service in services.items():
        for port in service.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), f"{name}: {port}"


def test_no_service_shares_the_host_pid_namespace_by_default(services: dict[str, Any]) -> None:
    # `pid: host` is for real GPUs and documented in a comment, not on for a demo.
    assert all("pid" not in s and "network_mode" not in s for s in services.values())


def test_bind_mounts_name_files_in_this_repository(services: dict[str, Any]) -> None:
    for name, service in services.items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (ROOT / source).exists(), f"{name}: {source}"
                assert volume.endswith(":ro"), f"{name}: bind mounts are read-only: {volume}"


def test_named_volumes_are_declared(compose: dict[str, Any], services: dict[str, Any]) -> None:
    used = {
        v.split(":")[0]
        for s in services.values()
        for v in s.get("volumes", [])
        if not v.startswith((".", "/"))
    }
    assert used == set(compose["volumes"])


def test_prometheus_scrapes_the_compose_services() -> None:
    config = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    targets = {
        c["job_name"]: [t for sc in c.get("static_configs", []) for t in sc["targets"]]
        for c in config["scrape_configs"]
    }
    assert targets["gpuwatch-agent"] == ["agent:9402"]
    assert targets["gpuwatch-server"] == ["server:9403"]


def test_grafana_provisioning_finds_the_mounted_dashboards(services: dict[str, Any]) -> None:
    provider = yaml.safe_load((ROOT / "grafana/provisioning/dashboards/gpuwatch.yml").read_text())
    path = provider["providers"][0]["options"]["path"]
    mounts = {v.split(":")[0]: v.split(":")[1] for v in services["grafana"]["volumes"]}
    assert mounts["./grafana/dashboards"] == path
    home = services["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home.startswith(path + "/")
    assert (ROOT / "grafana/dashboards" / home.removeprefix(path + "/")).is_file()
    datasource = yaml.safe_load(
        (ROOT / "grafana/provisioning/datasources/prometheus.yml").read_text()
    )
    assert datasource["datasources"][0]["url"] == "http://prometheus:9090"


def test_third_party_images_are_pinned(services: dict[str, Any]) -> None:
    for name in ("prometheus", "grafana"):
        image = services[name]["image"]
        assert re.fullmatch(r"[\w./-]+:v?\d+\.\d+\.\d+", image), image


def test_dockerfile_builds_from_python_slim_and_runs_as_non_root() -> None:
    lines = [
        line.strip()
        for line in DOCKERFILE.read_text(encoding="utf-8").splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    assert [line for line in lines if line.startswith("FROM ")] == ["FROM python:3.11-slim"]
    users = [line.split()[1] for line in lines if line.startswith("USER ")]
    assert users, "no USER: the container would run as root"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) != 0, "numeric non-root uid, so runAsNonRoot can check it"
    assert any("pip install" in line for line in lines)


def test_build_context_is_an_allow_list_without_the_virtualenv() -> None:
    ignore = (DOCKERFILE.parent / "Dockerfile.dockerignore").read_text(encoding="utf-8")
    rules = [r for r in ignore.splitlines() if r and not r.startswith("#")]
    assert rules[0] == "*"
    assert {"!pyproject.toml", "!README.md", "!gpuwatch/"} <= set(rules)
    # Everything pip needs to build the package is allowed back in.
    assert (ROOT / "README.md").is_file() and (ROOT / "pyproject.toml").is_file()
