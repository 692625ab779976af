"""The running parts of ``gpuwatch demo``: the server thread, the stand-ins, the agents.

Each part is started by the demo and stopped by it, and only what it started:

* the **server** runs in a thread of the demo (uvicorn, the app of ``gpuwatch server``);
* each host's **stand-ins** are booted from this run's copy of its scenario, whose
  content (and so state file) is this run's alone (:func:`demo_plan.write_scenario_copy`),
  and stopped by that state file, never by scenario name;
* each **agent** is a ``gpuwatch agent`` child process, because the fake GPUs sit
  beneath pynvml, which holds one library per process: three hosts, three processes.
  Each has its own config file, spool directory, token and ephemeral port.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuwatch.errors import GpuwatchError
from gpuwatch.nvml.fake.runtime_state import RuntimeState

AGENT_START_SECONDS = 60.0  # importing and booting on a loaded 2-core machine takes a while
AGENT_STOP_SECONDS = 10.0
_SERVING = re.compile(r"gpuwatch agent: serving (http://\S+)/metrics")


class DemoServer:
    """``gpuwatch server``'s app on a socket bound before anything else starts."""

    def __init__(self, listen: str) -> None:
        from gpuwatch.cli.server import bind_listen_socket
        from gpuwatch.settings import parse_host_port

        host, port = parse_host_port(listen)
        self._socket = bind_listen_socket(host, port)
        self.listen = f"{host}:{self._socket.getsockname()[1]}"  # port 0: the one we got
        shown = f"[{host}]" if ":" in host else host
        self.url = f"http://{shown}:{self._socket.getsockname()[1]}"
        self.settings: Any = None
        self._server: Any = None
        self._thread: threading.Thread | None = None

    def prepare(self, settings: Any, hostnames: list[str]) -> dict[str, str]:
        """Migrate the database and create one agent token per host."""
        from gpuwatch.server.auth import service as auth_service
        from gpuwatch.server.database import database_for
        from gpuwatch.server.database.migrate import upgrade

        self.settings = settings
        database = database_for(settings)
        try:
            upgrade(database)
            with database.writer() as session, session.begin():
                return {
                    name: auth_service.create_token(session=session, hostname=name, now=time.time())
                    for name in hostnames
                }
        finally:
            database.dispose()

    def start(self) -> None:
        import uvicorn

        from gpuwatch.server.app import create_app
        from gpuwatch.server.protocol import bounded_protocol

        config = uvicorn.Config(
            create_app(self.settings),
            http=bounded_protocol(self.settings.request_arrival_seconds),
            log_config=None,
            lifespan="on",
            ws="none",
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run,
            kwargs={"sockets": [self._socket]},
            name="gpuwatch-demo-server",
            daemon=True,
        )
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started and time.monotonic() < deadline:
            if not self._thread.is_alive():
                raise GpuwatchError("demo: the server stopped while starting")
            time.sleep(0.05)

    def stop(self) -> None:
        """Stop serving and the scheduler, and wait for both (its database is deleted next)."""
        if self._server is not None and self._thread is not None:
            self._server.should_exit = True
            self._thread.join(timeout=15)
        self._socket.close()


@dataclass
class Standins:
    """One host's booted scenario copy."""

    scenario: Any  # gpuwatch.nvml.fake.Scenario
    runtime_dir: Path
    state: RuntimeState

    @property
    def pids(self) -> list[int]:
        return [identity.pid for identity in self.state.standin_identities()]

    def stop(self) -> list[int]:
        """Stop this copy's supervisor and stand-ins (by its own state file)."""
        from gpuwatch.nvml.fake import lifecycle

        return lifecycle.stop(self.scenario, self.runtime_dir)


def boot_standins(scenario_file: Path, run_as: tuple[int, int] | None) -> Standins:
    """Boot this run's copy of a scenario. Raises ScenarioError, ConfigError, GpuwatchError."""
    from gpuwatch.nvml.fake import lifecycle
    from gpuwatch.nvml.fake.library import is_implemented
    from gpuwatch.nvml.fake.runtime_state import prepare_runtime_dir
    from gpuwatch.nvml.fake.scenario_file import load_scenario

    scenario = load_scenario(scenario_file, known_symbols=is_implemented)
    directory = prepare_runtime_dir(None)
    state = lifecycle.ensure_running(scenario, directory, run_as=run_as)
    return Standins(scenario, directory, state)


def agent_environment(config: Path) -> dict[str, str]:
    """The demo's environment without ``GPUWATCH_*`` variables, so nothing of a real
    setup reaches the demo's agents, plus the agent's own config file."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUWATCH_")}
    env["GPUWATCH_CONFIG"] = str(config)
    return env


class DemoAgent:
    """A ``gpuwatch agent`` child process; its stderr goes to ``log``."""

    def __init__(self, hostname: str, config: Path, log: Path) -> None:
        self.hostname = hostname
        self.config = config
        self.log = log
        self.url: str | None = None
        with log.open("wb") as err:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "gpuwatch", "agent", "--config", str(config)],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=err,
                env=agent_environment(config),
                cwd="/",
            )

    def wait_serving(self, deadline: float) -> str:
        """The agent's URL once it serves. Raises GpuwatchError if it exits or is late."""
        while time.monotonic() < deadline:
            found = _SERVING.search(self.log.read_text(errors="replace"))
            if found:
                self.url = found.group(1)
                return self.url
            if self.process.poll() is not None:
                break
            time.sleep(0.1)
        tail = self.log.read_text(errors="replace").strip().splitlines()[-3:]
        raise GpuwatchError(
            f"demo: the agent of {self.hostname} did not start: {' / '.join(tail) or 'no output'}"
        )

    def stop(self) -> None:
        """SIGTERM (the agent's own clean stop), then SIGKILL after a bounded wait."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=AGENT_STOP_SECONDS)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=AGENT_STOP_SECONDS)


def start_agents(agents: list[tuple[str, Path, Path]]) -> list[DemoAgent]:
    """Start every agent, then wait for all (they import and boot in parallel)."""
    started = [DemoAgent(hostname, config, log) for hostname, config, log in agents]
    deadline = time.monotonic() + AGENT_START_SECONDS
    try:
        for agent in started:
            agent.wait_serving(deadline)
    except GpuwatchError:
        for agent in started:
            agent.stop()
        raise
    return started
