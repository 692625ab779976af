"""The ``gpuwatch`` command line: the only place that prints errors and exits.

Each subcommand group lives in its own module and exposes ``register(app)``.
Modules import their heavy dependencies (pynvml, FastAPI, SQLAlchemy, torch) inside
the command functions, so ``gpuwatch --version`` and ``gpuwatch status`` start fast.
Exit codes are listed in :data:`gpuwatch.errors.EXIT_CODES` and docs/cli.md.
"""

from __future__ import annotations

import logging
import sys

import typer

from gpuwatch import __version__
from gpuwatch.errors import GpuwatchError

app = typer.Typer(
    name="gpuwatch",
    help="See shared-GPU out-of-memory coming, name the culprit, and clean up safely.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"gpuwatch {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
    log_level: str = typer.Option("warning", "--log-level", help="debug, info, warning or error."),
) -> None:
    level = getattr(logging, log_level.upper(), None)
    if not isinstance(level, int):
        raise typer.BadParameter(f"unknown log level {log_level!r}", param_hint="--log-level")
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _register_all() -> None:
    from gpuwatch.cli import agent, alerts, db, demo, doctor, fake, history, server, status, token

    for module in (agent, status, demo, fake, server, db, token, history, alerts, doctor):
        module.register(app)
    from gpuwatch.cli import reap

    reap.register(app)


def _register_for(args: list[str]) -> None:
    """Register what running ``args`` needs: ``gpuwatch agent`` only itself, because the
    agent is a daemon with a memory budget and the other commands' modules cost it
    about 1.3 MiB (bench/README.md, "Agent RSS"); anything else, every command."""
    if _subcommand(args) == "agent":
        from gpuwatch.cli import agent

        agent.register(app)
    else:
        _register_all()


def _subcommand(args: list[str]) -> str | None:
    """The subcommand ``args`` names, read past the root options (see :func:`_root`)."""
    rest = iter(args)
    for arg in rest:
        if arg == "--log-level":
            next(rest, None)  # its value
        elif not arg.startswith("-"):
            return arg
    return None


def main(argv: list[str] | None = None) -> None:
    """Entry point: run the app, turning gpuwatch errors into one line and an exit code."""
    _register_for(sys.argv[1:] if argv is None else argv)
    try:
        # standalone mode: the CLI framework reports usage errors itself (exit 2).
        app(args=argv)
    except GpuwatchError as err:
        print(f"gpuwatch: error: {err}", file=sys.stderr)
        sys.exit(err.exit_code)
    except KeyboardInterrupt:
        sys.exit(130)
