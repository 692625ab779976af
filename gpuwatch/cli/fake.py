"""``gpuwatch fake-nvml``: fake GPUs beneath pynvml, for demos, CI and GPU-less machines.

``list``   the bundled scenarios
``start``  boot a scenario's stand-in processes (once per host) and print their PIDs
``stop``   kill them and forget the scenario's state
``exec``   run any pynvml-based program (gpustat, nvitop, your own) on the fake GPUs

Scenario files are described in docs/scenarios.md. Exit codes: 3 for a bad scenario
file or runtime dir; ``exec`` exits with the program's own code (127: not found, 126: not runnable).
"""

from __future__ import annotations

import os
from pathlib import Path

import typer

_RUNTIME_DIR_HELP = "Shared state directory (default: $XDG_RUNTIME_DIR/gpuwatch-fake)."


def _runtime_dir_option() -> Path | None:
    return typer.Option(None, "--runtime-dir", metavar="DIR", help=_RUNTIME_DIR_HELP)


def register(app: typer.Typer) -> None:
    group = typer.Typer(
        name="fake-nvml",
        help="Fake GPUs beneath pynvml, driven by a scenario file (see docs/scenarios.md).",
        no_args_is_help=True,
    )

    @group.command("list")
    def list_scenarios() -> None:
        """List the bundled scenarios, usable by name wherever a scenario file is."""
        from gpuwatch.nvml.fake import bundled_scenario_names, load_scenario

        for name in bundled_scenario_names():
            typer.echo(f"{name:<12}  {load_scenario(name).description}")

    @group.command("start")
    def start(
        scenario: str = typer.Argument(
            ..., metavar="SCENARIO", help="Scenario file or bundled name."
        ),
        runtime_dir: Path | None = _runtime_dir_option(),
    ) -> None:
        """Boot SCENARIO's stand-in processes (no-op if running) and print their PIDs."""
        from datetime import datetime

        from gpuwatch.nvml.fake.library import is_implemented
        from gpuwatch.nvml.fake.lifecycle import ensure_running
        from gpuwatch.nvml.fake.runtime_state import prepare_runtime_dir
        from gpuwatch.nvml.fake.scenario import Spawn
        from gpuwatch.nvml.fake.scenario_file import load_scenario

        spec = load_scenario(scenario, known_symbols=is_implemented)
        state = ensure_running(spec, prepare_runtime_dir(runtime_dir))
        until = datetime.fromtimestamp(state.deadline).isoformat(sep=" ", timespec="seconds")
        typer.echo(f"# scenario {spec.name}: {len(spec.gpus)} GPUs; stand-ins exit by {until}")
        typer.echo("# PID\tGPU\tCOMMAND")
        for process in spec.processes:
            if isinstance(process.origin, Spawn) and process.key in state.processes:
                command = " ".join(process.origin.argv)
                typer.echo(f"{state.processes[process.key].pid}\t{process.gpu}\t{command}")

    @group.command("stop")
    def stop(
        scenario: str | None = typer.Argument(
            None, metavar="[SCENARIO]", help="Scenario file or bundled name."
        ),
        every: bool = typer.Option(False, "--all", help="Stop every scenario in the runtime dir."),
        runtime_dir: Path | None = _runtime_dir_option(),
    ) -> None:
        """Kill SCENARIO's stand-ins (or --all scenarios') and remove the shared state."""
        from gpuwatch.nvml.fake import lifecycle
        from gpuwatch.nvml.fake.runtime_state import prepare_runtime_dir
        from gpuwatch.nvml.fake.scenario_file import load_scenario

        if scenario is None and not every:
            raise typer.BadParameter("give a SCENARIO, or --all for every scenario")
        if scenario is not None and every:
            raise typer.BadParameter("give a SCENARIO or --all, not both")
        directory = prepare_runtime_dir(runtime_dir)
        if every:
            killed = lifecycle.stop_all(directory)
        else:
            assert scenario is not None
            killed = lifecycle.stop(load_scenario(scenario), directory)
        typer.echo(
            f"stopped {len(killed)} processes"
            + (f": {' '.join(map(str, killed))}" if killed else "")
        )

    @group.command(
        "exec",
        context_settings={"allow_interspersed_args": False, "ignore_unknown_options": True},
    )
    def exec_(
        scenario: str = typer.Argument(
            ..., metavar="SCENARIO", help="Scenario file or bundled name."
        ),
        command: list[str] = typer.Argument(
            ..., metavar="-- CMD [ARGS]...", help="The program to run."
        ),
        at: str | None = typer.Option(
            None,
            "--at",
            metavar="DURATION",
            help="Freeze scenario time here, e.g. 1h (default: live).",
        ),
        runtime_dir: Path | None = _runtime_dir_option(),
    ) -> None:
        """Run CMD with SCENARIO's fake GPUs beneath pynvml; exit with CMD's exit code."""
        from gpuwatch.errors import ConfigError
        from gpuwatch.nvml.fake.injection import injection_environment
        from gpuwatch.nvml.fake.library import is_implemented
        from gpuwatch.nvml.fake.lifecycle import ensure_running
        from gpuwatch.nvml.fake.runtime_state import prepare_runtime_dir
        from gpuwatch.nvml.fake.scenario_file import load_scenario
        from gpuwatch.quantities import parse_seconds

        if at is not None:
            try:
                parse_seconds(at)
            except ValueError as err:
                raise ConfigError(f"--at: {err}") from None
        # With option parsing stopped at SCENARIO, a "--" separator arrives as an argument.
        command = command[1:] if command[:1] == ["--"] else command
        if not command or not command[0]:  # "": execve refuses it with a ValueError
            raise typer.BadParameter("missing the command to run after --")
        if command[0].startswith("-") and "--" in command[1:]:
            # `exec SCENARIO --at 1h -- CMD`: the options came after SCENARIO, where
            # everything is CMD; running "--at" would fail as "not found" (127).
            raise typer.BadParameter(
                f"{command[0]} after SCENARIO: options go before it"
                " (fake-nvml exec [--at DURATION] [--runtime-dir DIR] SCENARIO -- CMD)"
            )
        spec = load_scenario(scenario, known_symbols=is_implemented)
        directory = prepare_runtime_dir(runtime_dir)
        # Boot here, so a bad scenario fails before CMD starts, and "attach = self" names
        # CMD itself: exec keeps this PID.
        ensure_running(spec, directory)
        # The child inherits this environment, plus the injection (not configuration).
        env = injection_environment(os.environ, spec.source, directory, at=at)
        try:
            os.execvpe(command[0], command, env)
        except OSError as err:
            typer.echo(f"gpuwatch: error: cannot run {command[0]}: {err.strerror}", err=True)
            # As a shell answers: 127 not found, 126 found but not runnable.
            raise typer.Exit(127 if isinstance(err, FileNotFoundError) else 126) from None

    app.add_typer(group, name="fake-nvml")
