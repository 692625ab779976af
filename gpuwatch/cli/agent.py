"""``gpuwatch agent``: poll NVML, export Prometheus metrics, push to the server."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import typer

CONFIG_HELP = "TOML config file (default /etc/gpuwatch/gpuwatch.toml; env GPUWATCH_CONFIG)."


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
            None, "--server", metavar="URL", help="Central server to push to."
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
            help="Also export DCGM_FI_DEV_FB_* (MiB) metrics.",
        ),
        config: Path | None = typer.Option(None, "--config", help=CONFIG_HELP),
    ) -> None:
        """Run the host agent: poll NVML and serve /metrics (systemd runs this)."""
        from gpuwatch.agent.assemble import build_agent
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
        running = build_agent(settings)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: running.stop())
        typer.echo(f"gpuwatch agent: serving {running.exporter.url}/metrics", err=True)
        running.run()
