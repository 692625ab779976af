"""``gpuwatch agent``: poll NVML, export Prometheus metrics, push to the server.

Checked before anything starts (exit 3, one line, nothing left running): the
``--listen`` address is free, and ``--server`` comes with a token (the server refuses
pushes without one, so starting would only fail at the first push).
"""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path
from typing import TYPE_CHECKING

import typer

if TYPE_CHECKING:
    from gpuwatch.agent.service import Agent
    from gpuwatch.settings import AgentSettings

CONFIG_HELP = "TOML config file (default /etc/gpuwatch/gpuwatch.toml; env GPUWATCH_CONFIG)."
TOKEN_HINT = (
    "set GPUWATCH_AGENT_TOKEN (or [agent] token, or --token) to the host's token "
    "from `gpuwatch token create HOSTNAME` on the server"
)


def use_config_file(path: Path | None) -> None:
    """Point settings at ``--config`` (the CLI is the one place allowed to set this)."""
    if path is not None:
        os.environ["GPUWATCH_CONFIG"] = str(path)


def register(app: typer.Typer) -> None:
    @app.command()
    def agent(
        fake_gpus: str | None = typer.Option(
            None,
            "--fake-gpus",
            metavar="SCENARIO",
            help="Simulate GPUs from a scenario file or bundled name.",
        ),
        listen: str | None = typer.Option(
            None, "--listen", metavar="HOST:PORT", help="Where to serve /metrics."
        ),
        server: str | None = typer.Option(
            None, "--server", metavar="URL", help="Central server to push to (needs a token)."
        ),
        token: str | None = typer.Option(
            None,
            "--token",
            metavar="TOKEN",
            help="Per-host token for --server (prefer GPUWATCH_AGENT_TOKEN).",
        ),
        poll_interval: float | None = typer.Option(
            None, "--poll-interval", help="Seconds between polls."
        ),
        processes: bool | None = typer.Option(
            None,
            "--collector.processes/--no-collector.processes",
            help="Export per-process series (capped).",
        ),
        dcgm_compat: bool | None = typer.Option(
            None,
            "--dcgm-compat/--no-dcgm-compat",
            help="Also export dcgm-exporter compatible DCGM_FI_* metrics (docs/dcgm.md).",
        ),
        config: Path | None = typer.Option(None, "--config", help=CONFIG_HELP),
    ) -> None:
        """Run the host agent: poll NVML and serve /metrics (systemd runs this)."""
        from gpuwatch.settings import AgentSettings, load

        use_config_file(config)
        settings = load(
            AgentSettings,
            fake_gpus=fake_gpus,
            listen=listen,
            server_url=server,
            token=token,
            poll_interval_seconds=poll_interval,
            process_metrics=processes,
            dcgm_compat=dcgm_compat,
        )
        check_startup(settings)
        from gpuwatch.agent.arenas import limit_malloc_arenas

        limit_malloc_arenas()  # before _build starts the first thread
        running = _build(settings)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: running.stop())
        typer.echo(f"gpuwatch agent: serving {running.exporter.url}/metrics", err=True)
        running.run()


def check_startup(settings: AgentSettings) -> None:
    """What would make the agent fail later, found now. Raises ``ConfigError``."""
    from gpuwatch.errors import ConfigError
    from gpuwatch.settings import parse_host_port

    if settings.server_url and (settings.token is None or not settings.token.get_secret_value()):
        raise ConfigError(f"--server {settings.server_url} needs a token: {TOKEN_HINT}")
    _check_listen(parse_host_port(settings.listen), settings.listen)


def _check_listen(address: tuple[str, int], shown: str) -> None:
    """Bind ``address`` the way the exporter will (SO_REUSEADDR), then let it go.

    Catches a busy port before the fake GPUs' stand-ins are booted, so a failed start
    leaves nothing behind. Port 0 always binds. Raises ``ConfigError``.
    """
    from gpuwatch.errors import ConfigError

    host, port = address
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((host, port))
    except OSError as err:
        raise ConfigError(_listen_error(shown, err)) from err


def _listen_error(shown: str, err: OSError) -> str:
    reason = err.strerror or str(err)
    return (
        f"cannot listen on {shown}: {reason} (another gpuwatch agent?); choose --listen HOST:PORT"
    )


def _build(settings: AgentSettings) -> Agent:
    """:func:`build_agent`, turning a bind failure (lost a race with another process
    after :func:`_check_listen`) into ``ConfigError`` after stopping any fake-GPU
    stand-ins this call booted."""
    from gpuwatch.agent.assemble import build_agent
    from gpuwatch.errors import ConfigError

    started = time.time()
    try:
        return build_agent(settings)
    except OSError as err:
        _stop_standins_booted_since(started)
        raise ConfigError(_listen_error(settings.listen, err)) from err


def _stop_standins_booted_since(started: float) -> None:
    """Stop the installed fake scenario if this process booted it (not if it joined
    stand-ins another process started: they are that process's)."""
    from gpuwatch.nvml import fake

    host = fake.installed_host()
    if host is not None and host.state.epoch >= started:
        host.stop()
