"""``gpuwatch demo``: the whole pipeline on simulated GPUs, no hardware needed.

It boots a scenario's stand-in processes, starts the central server on a throwaway
SQLite database, gives the agent a token, and runs the agent pushing to it: what
``/metrics``, ``gpuwatch status`` and the server's events show is what a real host
would show. Everything stops, and the stand-ins exit, on Ctrl-C or after ``--duration``.
"""

from __future__ import annotations

import signal
import socket
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import typer


def register(app: typer.Typer) -> None:
    @app.command()
    def demo(
        scenario: str = typer.Option(
            "workstation", "--scenario", help="Bundled scenario name or file."
        ),
        listen: str = typer.Option(
            "127.0.0.1:9402", "--listen", metavar="HOST:PORT", help="Agent endpoint."
        ),
        server_listen: str = typer.Option(
            "127.0.0.1:9403", "--server-listen", metavar="HOST:PORT", help="Server endpoint."
        ),
        duration: float | None = typer.Option(
            None, "--duration", help="Stop after this many seconds (default: run until Ctrl-C)."
        ),
    ) -> None:
        """Run agent and server on simulated GPUs, and show what they see (Ctrl-C stops)."""
        from gpuwatch.agent.assemble import build_agent
        from gpuwatch.agent.render import render_status
        from gpuwatch.nvml import fake
        from gpuwatch.settings import AgentSettings, ServerSettings, load

        stop = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
        with tempfile.TemporaryDirectory(prefix="gpuwatch-demo-") as tmp:
            data = Path(tmp)
            # Demo thresholds: a holder is idle after 30 s rather than an hour, with samples
            # every 5 s rather than every minute, so the forgotten notebook shows up while
            # you watch.
            server_settings = load(
                ServerSettings,
                listen=server_listen,
                data_dir=data / "server",
                agent_push_interval_seconds=2.0,
                idle_window_seconds=30.0,
                sample_interval_seconds=5.0,
            )
            server, server_url = _start_server(server_settings)
            try:
                token = _token_for(server_settings, socket.gethostname())
                settings = load(
                    AgentSettings,
                    fake_gpus=scenario,
                    listen=listen,
                    poll_interval_seconds=2.0,
                    push_interval_seconds=2.0,
                    server_url=server_url,
                    token=token,
                    spool_dir=data / "spool",
                )
                running = build_agent(settings)
                try:
                    snapshot = running.poll_once()
                    if snapshot is not None:
                        render_status(snapshot)
                    agent = threading.Thread(
                        target=running.run, name="gpuwatch-demo-agent", daemon=True
                    )
                    agent.start()
                    _print_guide(scenario, running.exporter.url, server_url, duration)
                    stop.wait(duration)
                    running.stop()
                    agent.join(timeout=10)
                    _print_events(server_url)
                finally:
                    fake.uninstall()
                    fake.stop(scenario)
            finally:
                server.should_exit = True


def _start_server(settings: Any) -> tuple[Any, str]:
    """Migrate, then serve the API from a thread; returns the uvicorn server and its URL."""
    import uvicorn

    from gpuwatch.cli.server import bind_listen_socket
    from gpuwatch.server.app import create_app
    from gpuwatch.server.database import database_for
    from gpuwatch.server.database.migrate import upgrade
    from gpuwatch.settings import parse_host_port

    database = database_for(settings)
    upgrade(database)
    database.dispose()
    host, port = parse_host_port(settings.listen)
    sock = bind_listen_socket(host, port)
    server = uvicorn.Server(
        uvicorn.Config(create_app(settings), log_config=None, lifespan="on", ws="none")
    )
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    return server, f"http://{host}:{sock.getsockname()[1]}"


def _token_for(settings: Any, hostname: str) -> str:
    from gpuwatch.server.auth import service as auth_service
    from gpuwatch.server.database import database_for

    database = database_for(settings)
    try:
        with database.writer() as session, session.begin():
            return auth_service.create_token(session=session, hostname=hostname, now=time.time())
    finally:
        database.dispose()


def _print_events(server_url: str) -> None:
    """What the server concluded while the demo ran (its database goes with the demo)."""
    import httpx

    try:
        items = httpx.get(f"{server_url}/api/v1/events", params={"limit": 50}, timeout=5).json()[
            "items"
        ]
    except (httpx.HTTPError, ValueError, KeyError):
        return
    typer.echo(f"\nthe server recorded {len(items)} event(s):", err=True)
    for event in sorted(items, key=lambda e: e["gpu_index"] if e["gpu_index"] is not None else -1):
        where = f"GPU {event['gpu_index']}" if event["gpu_index"] is not None else "host"
        typer.echo(f"  {where}  {event['kind']}/{event['reason']}: {event['summary']}", err=True)


def _print_guide(scenario: str, agent_url: str, server_url: str, duration: float | None) -> None:
    typer.echo(
        f"\nsimulated GPUs ({scenario}); the agent pushes to the server every 2 s, and the\n"
        f"server calls a holder idle after 30 s without SM activity (an hour by default):\n"
        f"  metrics    {agent_url}/metrics\n"
        f"  snapshot   {agent_url}/snapshot\n"
        f"  events     {server_url}/api/v1/events      (orphaned, idle, runaway, ...)\n"
        f"  fleet      {server_url}/api/v1/fleet\n"
        f"  API docs   {server_url}/docs\n"
        f"  again      gpuwatch status --fake-gpus {scenario}\n"
        f"  history    gpuwatch history events --server {server_url}\n"
        f"  explain    gpuwatch explain --text 'CUDA out of memory. Tried to allocate 2.00 GiB ...'\n"
        + ("Ctrl-C to stop." if duration is None else f"stopping in {duration:g} s."),
        err=True,
    )
