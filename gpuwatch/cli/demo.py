"""``gpuwatch demo``: the whole pipeline on three simulated hosts, no hardware needed.

It starts the central server (SQLite in a throwaway directory, the dashboard at ``/``)
with windows short enough to watch, a local webhook that receives its alerts, and three
agents, each a simulated host on its own scenario with its own owners: ``gpu-a`` (a
leak filling a GPU), ``gpu-b`` (a forgotten notebook beside a busy run) and ``gpu-c``
(an orphan, a dead PID, unclaimed memory). The terminal shows a live summary of what the
server found and what was sent, and the ``gpuwatch reap`` command that stops the idle
notebook. Ctrl-C, SIGTERM or ``--duration`` stops exactly what this run started: its
agents, its server, and the stand-ins of its own scenario copies.

Parts: :mod:`demo_plan` (hosts, timings, settings, files), :mod:`demo_parts` (server,
stand-ins, agents), :mod:`demo_sink` (the webhook), :mod:`demo_watch` (the summary).
"""

from __future__ import annotations

import secrets
import shlex
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

if TYPE_CHECKING:
    from gpuwatch.cli.demo_parts import DemoAgent, DemoServer, Standins
    from gpuwatch.cli.demo_plan import Timings
    from gpuwatch.cli.demo_sink import WebhookSink
    from gpuwatch.cli.demo_watch import Watch

DEFAULT_LIFETIME_SECONDS = 8 * 3600.0  # stand-ins of a run without --duration exit by then
# The stand-ins of a run with --duration outlive it by this much (they exit by themselves
# if the demo is killed), within the longest lifetime a scenario takes.
LIFETIME_MARGIN_SECONDS = 300.0
REFRESH_SECONDS = 1.0


def register(app: typer.Typer) -> None:
    @app.command()
    def demo(
        listen: str = typer.Option(
            "127.0.0.1:9403",
            "--listen",
            metavar="HOST:PORT",
            help="Where the server (dashboard and API) listens; port 0 picks a free one.",
        ),
        speed: float = typer.Option(
            1.0,
            "--speed",
            metavar="FACTOR",
            help="Run the scenarios FACTOR times faster and divide every window by it (0.000556 to 4).",
        ),
        duration: float | None = typer.Option(
            None,
            "--duration",
            metavar="SECONDS",
            min=1,
            help="Stop after this many seconds, at most 604500 (default: run until Ctrl-C).",
        ),
        as_json: bool = typer.Option(
            False, "--json", help="Print JSON lines (ready, found, alert, notification, stopped)."
        ),
    ) -> None:
        """Run a server and three simulated hosts, and watch what gpuwatch finds (Ctrl-C stops)."""
        from gpuwatch.cli.demo_plan import Timings
        from gpuwatch.errors import ConfigError
        from gpuwatch.settings import parse_host_port

        # Option values are exit 3, as `gpuwatch server --listen` and the others say.
        try:
            timings = Timings.at(speed)
        except ValueError as err:
            raise ConfigError(str(err)) from None  # it names --speed
        try:
            parse_host_port(listen)  # before anything starts, as --speed
        except ValueError as err:
            raise ConfigError(f"--listen: {err}") from None
        _check_duration(duration)
        _run(listen=listen, timings=timings, duration=duration, as_json=as_json)


def _check_duration(duration: float | None) -> None:
    """Refuse, before anything starts, a --duration the stand-ins' lifetime cannot hold
    (``inf``, ``nan`` and ``1e20`` pass typer's ``min=1``)."""
    from gpuwatch.errors import ConfigError
    from gpuwatch.nvml.fake.scenario_file import MAX_LIFETIME_SECONDS

    longest = MAX_LIFETIME_SECONDS - LIFETIME_MARGIN_SECONDS
    if duration is not None and not duration <= longest:
        raise ConfigError(
            f"--duration must be a number of seconds from 1 to {longest:.0f}"
            " (7 days less 5 minutes)"
        )


class _Started:
    """Everything one run started, so that exactly that, and only that, is stopped."""

    def __init__(self) -> None:
        self.sink: WebhookSink | None = None
        self.server: DemoServer | None = None
        self.standins: list[Standins] = []
        self.agents: list[DemoAgent] = []
        self.watch: Watch | None = None

    def stop_agents(self) -> None:
        for agent in self.agents:
            agent.stop()

    def stop(self) -> list[int]:
        """Agents, then server and sink, then this run's stand-ins; returns their PIDs."""
        self.stop_agents()
        if self.watch is not None:
            self.watch.close()
        if self.server is not None:
            self.server.stop()
        if self.sink is not None:
            self.sink.close()
        stopped: list[int] = []
        for standins in self.standins:
            stopped += standins.stop()
        return stopped


def _run(*, listen: str, timings: Timings, duration: float | None, as_json: bool) -> None:
    from gpuwatch.cli.demo_output import Output

    stop = threading.Event()
    reason = ["signal"]
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda *_: stop.set())
    started_at = time.time()
    output = Output(as_json=as_json)
    with tempfile.TemporaryDirectory(prefix="gpuwatch-demo-") as tmp:
        run = _Started()
        try:
            info = _start(run, Path(tmp), timings, listen, duration, started_at)
            assert run.watch is not None
            output.ready(info, run.watch)
            deadline = None if duration is None else started_at + duration
            while not stop.wait(REFRESH_SECONDS):
                output.update(run.watch.refresh(), run.watch)
                if deadline is not None and time.time() >= deadline:
                    reason[0] = "duration"
                    break
            run.stop_agents()  # their last snapshots land before the closing summary
            output.update(run.watch.refresh(), run.watch)
            output.closing(run.watch)
        finally:
            output.close()
            stopped = run.stop()
            if run.watch is not None:
                output.stopped(reason[0], run.watch, stopped)


def _start(
    run: _Started,
    data: Path,
    t: Timings,
    listen: str,
    duration: float | None,
    started_at: float,
) -> dict[str, Any]:
    """Start sink, server, stand-ins and agents (in that order); returns what to print."""
    from gpuwatch.cli import demo_plan as plan
    from gpuwatch.cli.demo_parts import DemoServer, boot_standins, start_agents
    from gpuwatch.cli.demo_sink import WebhookSink
    from gpuwatch.cli.demo_watch import Watch

    run_id = plan.new_run_id()
    hostnames = [h.hostname for h in plan.HOSTS]
    run.sink = WebhookSink(secrets.token_urlsafe(32))
    run.server = server = DemoServer(listen)
    settings = plan.server_settings(
        t,
        listen=server.listen,
        data_dir=data / "server",
        sink_url=run.sink.url,
        sink_secret=run.sink.secret,
        dashboard=server.url + "/",
    )
    tokens = server.prepare(settings, hostnames)
    run.sink.start()
    server.start()

    lifetime = DEFAULT_LIFETIME_SECONDS if duration is None else duration + LIFETIME_MARGIN_SECONDS
    (data / "scenarios").mkdir()
    run_as = plan.standin_user()
    agents: list[tuple[str, Path, Path]] = []
    hosts: list[dict[str, Any]] = []
    for host in plan.HOSTS:
        scenario = plan.write_scenario_copy(
            host, data / "scenarios", run_id=run_id, speed=t.speed, lifetime=lifetime
        )
        standins = boot_standins(scenario, run_as)
        run.standins.append(standins)
        home = data / host.hostname
        home.mkdir(mode=0o700)
        config = plan.write_agent_config(
            home / "agent.toml",
            {
                "fake_gpus": scenario,
                "hostname": host.hostname,
                "agent_id": f"gpuwatch-demo-{run_id}-{host.hostname}",
                "listen": "127.0.0.1:0",
                "poll_interval_seconds": t.poll,
                "push_interval_seconds": t.push,
                "server_url": server.url,
                "token": tokens[host.hostname],
                "spool_dir": home / "spool",
            },
            {"audit_log": home / "reap-audit.jsonl"},
        )
        agents.append((host.hostname, config, home / "agent.log"))
        hosts.append(
            {
                "hostname": host.hostname,
                "scenario": host.scenario,
                "shows": host.shows,
                "scenario_file": str(scenario),
                "config": str(config),
                "state_file": str(_state_file(standins)),
                "standin_pids": standins.pids,
            }
        )
    run.agents = start_agents(agents)
    for described, agent in zip(hosts, run.agents, strict=True):
        described["agent_url"] = agent.url
    run.watch = Watch(server.url, run.sink, hostnames, started_at)
    reap = next(h for h in hosts if h["hostname"] == plan.REAP_HOST)
    reap_args = ["reap", "--config", reap["config"], "--agent", reap["agent_url"]]
    reap_args += ["--idle", f"{t.reap_idle:g}s", "--yes"]
    return {
        "server_url": server.url,
        "dashboard_url": server.url + "/",
        "sink_url": run.sink.url,
        "speed": t.speed,
        "timings": t.described(),
        "duration": duration,
        "standins_run_as_uid": None if run_as is None else run_as[0],
        "hosts": hosts,
        "reap_command": shlex.join([*_program(), *reap_args]),
        "reap_argv": [sys.executable, "-m", "gpuwatch", *reap_args],
    }


def _state_file(standins: Standins) -> Path:
    from gpuwatch.nvml.fake.runtime_state import state_path

    scenario = standins.scenario
    return state_path(standins.runtime_dir, scenario.name, scenario.content_hash)


def _program() -> list[str]:
    """How to run this gpuwatch from a shell: ``gpuwatch`` when that is the one on PATH,
    else the script beside this interpreter by its absolute path (the user's shell is
    not in ./dev's directory), else ``-m``."""
    script = Path(sys.executable).parent / "gpuwatch"
    if not script.is_file():
        return [sys.executable, "-m", "gpuwatch"]
    if shutil.which("gpuwatch") == str(script):
        return ["gpuwatch"]
    return [str(script.absolute())]
