"""``gpuwatch status``: one poll, printed like gpustat (or as JSON for scripts)."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    @app.command()
    def status(
        fake_gpus: str | None = typer.Option(
            None,
            "--fake-gpus",
            metavar="SCENARIO",
            help="Simulate GPUs from a scenario file or bundled name.",
        ),
        as_json: bool = typer.Option(False, "--json", help="Print the HostSnapshot as JSON."),
    ) -> None:
        """Show every GPU, who holds its memory, and memory nobody accounts for."""
        from gpuwatch.agent.assemble import build_sampler
        from gpuwatch.agent.render import render_status
        from gpuwatch.agent.state import AgentState
        from gpuwatch.settings import AgentSettings, load

        settings = load(AgentSettings, fake_gpus=fake_gpus)
        sampler = build_sampler(settings, AgentState(), one_shot=True)
        snapshot = sampler.poll()
        if as_json:
            typer.echo(snapshot.model_dump_json(indent=2))
        else:
            # Why some owners may be unknown (hidepid, a user namespace, the image's
            # passwd file): without it a hidden process reads like a missing one.
            render_status(snapshot, notes=sampler.reader_notes)
