"""The agent a deployment file starts pushes with the token its instructions create.

The server accepts a host's token only for snapshots of that host (403 otherwise, which
the agent counts as ``auth_failed`` and keeps spooling). The host is the agent's
``hostname`` setting, else the machine's hostname, and in a container that is the pod
name or the container id, not the name the token was created for. So each deployment
must set the agent's hostname to the name its instructions create the token for.

Checked for real, not on paper: a ``gpuwatch server``, a token created as the file's
comments say, and the agent started as the file starts it (the Kubernetes DaemonSet's
own shell wrapper and environment; the compose service's command and environment), on
simulated GPUs. The push must be accepted. This machine's hostname differs from the
names used, as a container's would.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from support.processes import stop_processes

ROOT = Path(__file__).resolve().parents[2]
DAEMONSET = ROOT / "deploy" / "kubernetes" / "agent.yaml"
COMPOSE = ROOT / "docker-compose.yml"
DEPLOY_DOC = ROOT / "docs" / "deploy.md"
GPUWATCH = [sys.executable, "-m", "gpuwatch"]
DEADLINE_SECONDS = 45.0
NODE = "gpu-node-01"


class Stack:
    """A server on SQLite and the agents started against it; stopped at the end."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        (tmp / "run").mkdir()
        self.db_url = f"sqlite:///{tmp / 'gpuwatch.db'}"
        # What the image's ENV gives both containers, with this machine's paths.
        self.env = {
            "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '/usr/bin:/bin')}",
            "HOME": str(tmp),
            "XDG_RUNTIME_DIR": str(tmp / "run"),
            "GPUWATCH_CONFIG": "/dev/null",
            "GPUWATCH_AGENT_LISTEN": "127.0.0.1:0",
            "GPUWATCH_AGENT_SPOOL_DIR": str(tmp / "spool"),
            "GPUWATCH_AGENT_POLL_INTERVAL_SECONDS": "0.5",
            "GPUWATCH_AGENT_PUSH_INTERVAL_SECONDS": "0.5",
        }
        self.processes: list[subprocess.Popen[bytes]] = []
        self.server_url = ""

    def cli(self, *args: str) -> str:
        result = subprocess.run(
            [*GPUWATCH, *args], env=self.env, capture_output=True, text=True, timeout=120
        )
        assert result.returncode == 0, result.stderr
        return result.stdout

    def start(self, name: str, argv: list[str], env: dict[str, str]) -> Path:
        log = self.tmp / f"{name}.log"
        with log.open("wb") as out:
            self.processes.append(
                subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)
            )
        return log

    def start_server(self) -> None:
        self.cli("db", "upgrade", "--database-url", self.db_url)
        log = self.start(
            "server",
            [*GPUWATCH, "server", "--listen", "127.0.0.1:0", "--database-url", self.db_url],
            self.env,
        )
        self.server_url = url_in(log, "listening on")

    def token(self, host: str) -> str:
        return (
            self.cli("token", "create", host, "--database-url", self.db_url)
            .strip()
            .splitlines()[-1]
        )

    def close(self) -> None:
        stop_processes(self.processes)
        subprocess.run(
            [*GPUWATCH, "fake-nvml", "stop", "--all"], env=self.env, capture_output=True, timeout=60
        )


def url_in(log: Path, banner: str) -> str:
    deadline = time.monotonic() + DEADLINE_SECONDS
    while time.monotonic() < deadline:
        match = re.search(rf"{banner} (http://\S+)", log.read_text(errors="replace"))
        if match:
            return match.group(1).removesuffix("/metrics").rstrip("/")
        time.sleep(0.05)
    raise AssertionError(f"no {banner!r} in {log.name}:\n{log.read_text(errors='replace')}")


def pushes(agent_log: Path) -> dict[str, float]:
    """The agent's push counters, once it has accepted snapshots or been refused."""
    agent = url_in(agent_log, "serving")
    counters: dict[str, float] = {}
    deadline = time.monotonic() + DEADLINE_SECONDS
    while time.monotonic() < deadline:
        text = httpx.get(f"{agent}/metrics", timeout=5).text
        counters = {
            f"{name}:{result}": float(value)
            for name, result, value in re.findall(
                r'^gpuwatch_agent_(snapshots_pushed|push_batches)_total\{result="(\w+)"\} (\S+)$',
                text,
                flags=re.MULTILINE,
            )
        }
        if counters.get("snapshots_pushed:accepted") or counters.get("push_batches:auth_failed"):
            return counters
        time.sleep(0.25)
    raise AssertionError(
        f"no push answered in {DEADLINE_SECONDS} s: {counters}\n{agent_log.read_text()}"
    )


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    assert socket.gethostname() not in (NODE, "demo-agent"), "this test needs another hostname"
    stack = Stack(tmp_path)
    try:
        stack.start_server()
        yield stack
    finally:
        stack.close()


def _kubernetes_env(container: dict[str, Any], node: str) -> dict[str, str]:
    """The container's environment as the kubelet builds it: fieldRef spec.nodeName, and
    $(VAR) references to variables defined earlier in the list."""
    env: dict[str, str] = {}
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = re.sub(
                r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), str(item["value"])
            )
        elif item.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "spec.nodeName":
            env[item["name"]] = node
    return env


def test_the_daemonset_agent_pushes_with_its_nodes_token(stack: Stack) -> None:
    """As docs/deploy.md says: a token per node, created for the node's name, stored in the
    Secret under that name; the DaemonSet's wrapper picks it and its agent pushes."""
    (daemonset,) = [d for d in yaml.safe_load_all(DAEMONSET.read_text()) if d]
    (container,) = daemonset["spec"]["template"]["spec"]["containers"]
    tokens = stack.tmp / "tokens"
    tokens.mkdir()
    (tokens / NODE).write_text(stack.token(NODE))
    script = container["args"][0].replace("/etc/gpuwatch/tokens", str(tokens))
    script, replaced = re.subn(r"--server=\S+", f"--server={stack.server_url}", script)
    assert replaced == 1, script
    env = {
        **stack.env,
        **_kubernetes_env(container, NODE),
        "GPUWATCH_AGENT_FAKE_GPUS": "workstation",
    }
    log = stack.start("agent-k8s", [*container["command"], script], env)
    counters = pushes(log)
    assert counters.get("snapshots_pushed:accepted", 0) > 0, (
        f"the server refused node {NODE}'s token: {counters}\n{log.read_text()}"
    )


def test_the_compose_agent_pushes_with_the_token_its_comments_create(stack: Stack) -> None:
    text = COMPOSE.read_text(encoding="utf-8")
    (host,) = set(re.findall(r"gpuwatch token create (\S+)", text))
    doc = DEPLOY_DOC.read_text(encoding="utf-8").split("## Try it: docker compose", 1)[1]
    assert f"docker compose exec server gpuwatch token create {host}" in doc
    agent = yaml.safe_load(text)["services"]["agent"]
    token = stack.token(host)
    environment = {
        name: str(value).replace("${GPUWATCH_AGENT_TOKEN:-}", token)
        for name, value in agent.get("environment", {}).items()
    }
    assert environment["GPUWATCH_AGENT_TOKEN"] == token
    # The container runs its entrypoint (a wrapper that adds --server when the token is
    # set) with the command as arguments; `$$` is Compose's escape for `$`.
    argv = [
        arg.replace("$$", "$").replace("http://server:9403", stack.server_url)
        for arg in [*agent["entrypoint"], *agent["command"]]
    ]
    assert agent["command"][0] == "agent" and f"--server={stack.server_url}" in argv[2]
    log = stack.start("agent-compose", argv, {**stack.env, **environment})
    counters = pushes(log)
    assert counters.get("snapshots_pushed:accepted", 0) > 0, (
        f"the server refused the {host!r} token: {counters}\n{log.read_text()}"
    )
