"""The ``gpuwatch`` command line: the only place that prints errors and exits.

Each subcommand group lives in its own module and exposes ``register(app)``.
Modules import their heavy dependencies (pynvml, FastAPI, SQLAlchemy, torch) inside
the command functions, so ``gpuwatch --version`` and ``gpuwatch status`` start fast.
Exit codes are listed in :data:`gpuwatch.errors.EXIT_CODES` and docs/exit-codes.md.
"""

from __future__ import annotations

import errno
import functools
import io
import logging
import os
import sys
from typing import TYPE_CHECKING, Any

from gpuwatch import __version__
from gpuwatch.errors import ConfigError, GpuwatchError
from gpuwatch.terminal_text import printable

if TYPE_CHECKING:
    import typer

DEFAULT_LOG_LEVEL = "warning"


@functools.cache
def _app() -> typer.Typer:
    """The typer app, built on first use: ``gpuwatch agent`` starts without it (see
    :func:`_serve_agent_without_typer`)."""
    import typer

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
        log_level: str = typer.Option(
            DEFAULT_LOG_LEVEL, "--log-level", help="debug, info, warning or error."
        ),
    ) -> None:
        if not _configure_logging(log_level):
            # A bad value, not a usage error: exit 3, like every other (docs/exit-codes.md).
            raise ConfigError(f"--log-level {log_level!r}: use debug, info, warning or error")

    return app


def _configure_logging(log_level: str) -> bool:
    """Log at ``log_level`` (a :mod:`logging` level name, any case); False if it is none."""
    level = getattr(logging, log_level.upper(), None)
    if not isinstance(level, int):
        return False
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return True


def _register_all() -> None:
    from gpuwatch.cli import agent, alerts, db, demo, doctor, fake, history, server, status, token

    app = _app()
    for module in (agent, status, demo, fake, server, db, token, history, alerts, doctor):
        module.register(app)
    from gpuwatch.cli import reap

    reap.register(app)


def _register_for(args: list[str]) -> None:
    """Register what running ``args`` needs: ``gpuwatch agent`` only itself, because the
    agent is a daemon with a memory budget and the other commands' modules cost it
    about 1.3 MiB (bench/README.md, "Agent RSS"); anything else, every command."""
    if _split(args)[1] == "agent":
        from gpuwatch.cli import agent

        agent.register(_app())
    else:
        _register_all()


def _split(args: list[str]) -> tuple[list[str], str | None, list[str]]:
    """``args`` as the root options (see :func:`_app`), the subcommand they name, and
    the subcommand's own arguments."""
    i = 0
    while i < len(args):
        if args[i] == "--log-level":
            i += 2  # and its value
        elif args[i].startswith("-"):
            i += 1
        else:
            return args[:i], args[i], args[i + 1 :]
    return args, None, []


def _serve_agent_without_typer(args: list[str]) -> bool:
    """Run ``gpuwatch agent`` without importing typer: the daemon has a 40 MiB budget,
    and typer cost it 1.6 MiB beside the pydantic it needs anyway (bench/load.py's agent
    RSS phase: 45.6 MiB at the end with typer, 44.0 without). False, having done nothing,
    for anything but options it can read as typer would (help, mistakes, other
    commands): those go to the typer app, for its exact text and exit code."""
    root, command, rest = _split(args)
    if command != "agent":
        return False
    from gpuwatch.cli import agent

    log_level = _root_log_level(root)
    values = agent.parse_fast(rest)
    if log_level is None or values is None or not _configure_logging(log_level):
        return False
    agent.serve(values)
    return True


def _root_log_level(root: list[str]) -> str | None:
    """The ``--log-level`` that root options consisting only of it give (the last
    one); None if they hold anything else, such as ``--version`` or ``--help``."""
    level = DEFAULT_LOG_LEVEL
    rest = iter(root)
    for arg in rest:
        flag, equals, attached = arg.partition("=")
        if flag != "--log-level":
            return None
        value = attached if equals else next(rest, None)
        if value is None:
            return None
        level = value
    return level


def main(argv: list[str] | None = None) -> None:
    """Entry point: run the app, turning gpuwatch errors into one line and an exit code."""
    args = sys.argv[1:] if argv is None else argv
    _reopen_closed_standard_streams()
    stdout_was_null = _is_devnull(1)
    try:
        if not _serve_agent_without_typer(args):
            _register_for(args)
            import typer.main

            command = typer.main.get_command(_app())
            _plain_metavars(command)
            # Not standalone: a usage error comes back here, to be one line (exit 2, or
            # 3 for a bad value) rather than the framework's boxed message.
            code = command.main(args=argv, standalone_mode=False)
            sys.exit(code if isinstance(code, int) else 0)
    except GpuwatchError as err:
        # One line, whatever the message quotes (a refused process's command line is
        # another user's text: an ESC or a newline in it would drive the terminal).
        print(f"gpuwatch: error: {printable(str(err))}", file=sys.stderr)
        sys.exit(err.exit_code)

    except KeyboardInterrupt:
        sys.exit(130)
    except BrokenPipeError:
        _stdout_closed()
    except OSError as err:
        if err.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EBADF):
            _unexpected(err)
        # Output (or a file) could not be written: the machine's fault, not a bug.
        print(f"gpuwatch: error: cannot write: {err.strerror}", file=sys.stderr)
        sys.exit(1)
    except SystemExit as exit_:
        # Click and rich answer a closed stdout (EPIPE) with exit 1, the code of a bug:
        # click marks that case by wrapping sys.stdout, rich by pointing it at /dev/null.
        if exit_.code == 1 and (
            type(sys.stdout).__name__ == "PacifyFlushWrapper"
            or (_is_devnull(1) and not stdout_was_null)
        ):
            _stdout_closed()
        raise
    except Exception as err:  # a usage error, or the last resort: see _unexpected
        _usage(err, args)
        _unexpected(err)


def _usage(err: Exception, args: list[str]) -> None:
    """Exit for the CLI framework's own errors: a bad option or argument value as one
    line (exit 3, as when a command's own code refuses one), any other usage error as
    one line (exit 2), the help where nothing was given, 130 for Ctrl-C at a prompt.
    Typer's own copy of click is looked up, not imported: ``gpuwatch agent`` runs
    without it."""
    click = sys.modules.get("typer._click")
    if click is None:
        return
    if isinstance(err, click.exceptions.NoArgsIsHelpError):
        err.show()  # the help text itself, as asked for by giving nothing
        sys.exit(err.exit_code)
    if _is_bad_value(err, click):
        message = _bad_value_message(err, args)
        print(f"gpuwatch: error: {printable(message)}{_see_help(err)}", file=sys.stderr)
        sys.exit(ConfigError.exit_code)
    if isinstance(err, click.ClickException):
        message = " ".join(err.format_message().split())
        print(f"gpuwatch: error: {printable(message)}{_see_help(err)}", file=sys.stderr)
        sys.exit(err.exit_code)
    abort = getattr(sys.modules.get("typer.exceptions"), "Abort", None)
    if abort is not None and isinstance(err, abort):
        sys.exit(130)


def _plain_metavars(command: Any) -> None:
    """Help that reads as the docs do: no ``<bool>`` beside a switch (``--json``,
    ``--help``), which made it look as if it took a value, and an argument shown as
    ``HOST`` (its description's word) rather than ``host``. Each command's help option
    is made here, as click would make it on first use, to be changed too."""
    from typer import _click as click

    for sub in getattr(command, "commands", {}).values():
        _plain_metavars(sub)
    context = click.Context(command, help_option_names=["-h", "--help"])
    command.get_help_option(context)
    for param in [*command.params, command._help_option]:
        if param is None or param.metavar is not None:
            continue
        if getattr(param, "is_flag", False):
            param.metavar = ""
        elif param.param_type_name == "argument" and param.name:
            param.metavar = param.name.upper()


def _see_help(err: Exception) -> str:
    context = getattr(err, "ctx", None)
    return "" if context is None else f" (see: {printable(context.command_path)} -h)"


def _is_bad_value(err: Exception, click: Any) -> bool:
    """A value the parser refused for one option or argument (its type, range, choices
    or callback): exit 3, the code of a bad option value (docs/exit-codes.md). A
    missing one, and a check raised from a command's body without naming a parameter
    ("give --idle DURATION, or --pid PID"), are usage errors: exit 2."""
    return (
        isinstance(err, click.exceptions.BadParameter)
        and not isinstance(err, click.exceptions.MissingParameter)
        and (err.param is not None or err.param_hint is not None)
    )


# Pydantic's words for the checks typer runs on a value, as gpuwatch says them.
_PYDANTIC_REASONS = {
    "greater_than_equal": "must be at least {ge}",
    "greater_than": "must be more than {gt}",
    "less_than_equal": "must be at most {le}",
    "less_than": "must be less than {lt}",
    "int_parsing": "must be a whole number",
    "int_from_float": "must be a whole number",
    "float_parsing": "must be a number",
    "finite_number": "must be a finite number",
    "bool_parsing": "must be true or false",
    "literal_error": "must be one of {expected}",
    "enum": "must be one of {expected}",
}
_LONGEST_VALUE_SHOWN = 80


def _bad_value_message(err: Any, args: list[str]) -> str:
    """``--duration '0': must be at least 1``: the option (or argument) as given, its
    value, and why, in gpuwatch's words rather than pydantic's."""
    param = err.param
    if param is None:
        name = err.param_hint if isinstance(err.param_hint, str) else "/".join(err.param_hint)
    elif getattr(param, "param_type_name", "") == "argument":
        name = (param.metavar or param.name or "argument").upper()
    else:
        name = "/".join(param.opts)
    value = _given_value(err, args)
    reason = " ".join(_reason(err).split())
    if value is None or not isinstance(value, str):
        return f"{name}: {reason}"
    shown = (
        value if len(value) <= _LONGEST_VALUE_SHOWN else value[: _LONGEST_VALUE_SHOWN - 3] + "..."
    )
    if repr(value) in reason:  # the command's own check quotes it already
        return f"{name}: {reason}"
    return f"{name} {shown!r}: {reason}"


def _reason(err: Any) -> str:
    cause = err.__cause__
    errors = getattr(cause, "errors", None)
    if callable(errors):
        try:
            first = errors()[0]
            template = _PYDANTIC_REASONS.get(first["type"])
            if template is not None:
                return template.format(**{k: _number(v) for k, v in first.get("ctx", {}).items()})
            message = str(first["msg"]).removeprefix("Value error, ")
            return message.replace("Input should be", "must be", 1)
        except (IndexError, KeyError, TypeError, ValueError):
            pass
    return str(err.message)


def _number(value: Any) -> Any:
    """``1.0`` as ``1``: a bound typer stored as a float for an integer option."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _given_value(err: Any, args: list[str]) -> Any:
    """The text given for the refused parameter, read again from ``args`` with each
    command's own parser (click does not keep it); None if it cannot be told."""
    chain = []
    context = err.ctx
    while context is not None:
        chain.append(context)
        context = context.parent
    rest = list(args)
    try:
        for context in reversed(chain):
            given, remaining, _ = context.command.make_parser(context).parse_args(args=rest)
            if context is err.ctx:
                return given.get(err.param.name) if err.param is not None else None
            rest = remaining[1:]  # past the subcommand's name
    except Exception:  # only a nicer message is lost
        return None
    return None


def _is_devnull(fd: int) -> bool:
    try:
        here, null = os.fstat(fd), os.stat(os.devnull)
    except OSError:
        return False
    return (here.st_dev, here.st_ino) == (null.st_dev, null.st_ino)


def _stdout_closed() -> None:
    """The reader of stdout went away (``| head -1``): nothing to say, and nowhere to say
    it. Exit as a shell reports a process killed by SIGPIPE (128 + 13), and point stdout
    at /dev/null so the interpreter's final flush does not complain."""
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.close(null)
    sys.exit(141)


def _unexpected(err: Exception) -> None:
    """A failure no boundary translated is a bug, but the promise still holds: one line
    and exit 1 (unexpected runtime failure), not a traceback. The traceback is kept for
    whoever reports it: ``--log-level debug`` prints it."""
    if logging.getLogger().isEnabledFor(logging.DEBUG):
        logging.getLogger("gpuwatch").exception("unexpected failure")
    detail = printable(" ".join(str(err).split())[:300]) or "no detail"
    print(
        f"gpuwatch: error: unexpected {type(err).__name__}: {detail} "
        "(a bug; --log-level debug shows where)",
        file=sys.stderr,
    )
    sys.exit(1)


def _reopen_closed_standard_streams() -> None:
    """Give a closed stdin, stdout or stderr (``<&-``, ``>&-``) /dev/null instead.

    Python leaves ``sys.stdin`` None then, and code that asks ``sys.stdin.isatty()``
    (explain, reap's prompt) would crash; worse, the next file opened would get the
    closed descriptor's number, and whatever is written to "stdout" would land in it.
    Writes to a stdout closed that way still fail (:class:`_ClosedOutput`).
    """
    for fd, name, mode in ((0, "stdin", "r"), (1, "stdout", "w"), (2, "stderr", "w")):
        try:
            os.fstat(fd)
            continue
        except OSError:
            pass
        null = os.open(os.devnull, os.O_RDWR)
        if null != fd:
            os.dup2(null, fd)
            os.close(null)
        if fd == 1:
            # Not a silent /dev/null: what a command prints may be the only copy of
            # something (`token create`'s token), so writing fails, as it would have.
            sys.stdout = _ClosedOutput(open(fd, "wb", closefd=False))  # noqa: SIM115 - lives as long as the process
        elif getattr(sys, name) is None:
            setattr(sys, name, open(fd, mode, closefd=False))  # noqa: SIM115 - lives as long as the process


class _ClosedOutput(io.TextIOWrapper):
    """``sys.stdout`` for a process started with it closed (``>&-``): every write fails
    with EBADF, as a write to the closed descriptor would, and nothing is kept to flush
    at exit. :func:`main` reports it as "cannot write", exit 1."""

    def write(self, text: str) -> int:
        raise OSError(errno.EBADF, "standard output is closed")
