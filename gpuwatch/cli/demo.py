"""``gpuwatch demo``: the whole pipeline on simulated GPUs, no hardware needed."""

from __future__ import annotations

import signal
import threading

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
        duration: float | None = typer.Option(
            None, "--duration", help="Stop after this many seconds (default: run until Ctrl-C)."
        ),
    ) -> None:
        """Run the agent on simulated GPUs and show what it sees (Ctrl-C stops it)."""
        from gpuwatch.agent.assemble import build_agent
        from gpuwatch.agent.render import render_status
        from gpuwatch.settings import AgentSettings, load

        settings = load(AgentSettings, fake_gpus=scenario, listen=listen, poll_interval_seconds=2.0)
        running = build_agent(settings)
        snapshot = running.poll_once()
        if snapshot is not None:
            render_status(snapshot)
        stop = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
        worker = threading.Thread(target=running.run, name="gpuwatch-demo-agent", daemon=True)
        worker.start()
        url = running.exporter.url
        typer.echo(
            f"\nagent on simulated GPUs ({scenario}):\n"
            f"  metrics   {url}/metrics\n"
            f"  snapshot  {url}/snapshot\n"
            f"  again     gpuwatch status --fake-gpus {scenario}\n"
            f"  explain   gpuwatch explain --text 'CUDA out of memory. Tried to allocate 2.00 GiB ...'\n"
            + ("Ctrl-C to stop." if duration is None else f"stopping in {duration:g} s."),
            err=True,
        )
        stop.wait(duration)
        running.stop()
        worker.join(timeout=10)
