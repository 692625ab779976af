"""``gpuwatch agent``: poll NVML, export Prometheus metrics, push to the server.

Checked before anything starts (exit 3, one line, nothing left running): the
``--listen`` address is free, and ``--server`` comes with a token (the server refuses
pushes without one, so starting would only fail at the first push).
"""

from __future__ import annotations

import errno
import os
import re
import signal
import socket
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import typer

    from gpuwatch.agent.service import Agent
    from gpuwatch.settings import AgentSettings

CONFIG_HELP = "TOML config file (default /etc/gpuwatch/gpuwatch.toml; env GPUWATCH_CONFIG)."
TOKEN_HINT = (
    "set GPUWATCH_AGENT_TOKEN (or [agent] token, or --token) to the host's token "
    "from `gpuwatch token create HOSTNAME` on the server"
)


def use_config_file(path: Path | None) -> None:
    """Point settings at ``--config`` (the CLI is the one place allowed to set this).

    A file named on the command line must be there: settings skip a missing file (the
    default path need not exist), which would run on defaults without a word.
    Raises ``ConfigError``."""
    if path is None:
        return
    from gpuwatch.errors import ConfigError
    from gpuwatch.files import file_problem

    problem = file_problem(path)
    if problem is not None:
        raise ConfigError(f"--config {path}: {problem}")
    os.environ["GPUWATCH_CONFIG"] = str(path)


@dataclass(frozen=True)
class AgentOption:
    """One option of ``gpuwatch agent``, none given by default (``None``: the settings
    file or environment decides). Both the typer command (help, errors) and
    :func:`parse_fast` (the daemon's start) are built from :data:`OPTIONS`."""

    name: str  # the AgentSettings field it overrides ("config": the file to read them from)
    flags: str  # "--name", or "--on/--off" for a switch
    kind: type[str] | type[float] | type[bool] | type[Path]
    help: str
    metavar: str | None = None


OPTIONS = (
    AgentOption(
        "fake_gpus", "--fake-gpus", str, "Simulate GPUs from a scenario file or bundled name.",
        "SCENARIO",
    ),
    AgentOption("listen", "--listen", str, "Where to serve /metrics.", "HOST:PORT"),
    AgentOption("server_url", "--server", str, "Central server to push to (needs a token).", "URL"),
    AgentOption(
        "token", "--token", str, "Per-host token for --server (prefer GPUWATCH_AGENT_TOKEN).",
        "TOKEN",
    ),
    AgentOption("poll_interval_seconds", "--poll-interval", float, "Seconds between polls."),
    AgentOption(
        "process_metrics", "--collector.processes/--no-collector.processes", bool,
        "Export per-process series (capped).",
    ),
    AgentOption(
        "dcgm_compat", "--dcgm-compat/--no-dcgm-compat", bool,
        "Also export dcgm-exporter compatible DCGM_FI_* metrics (docs/dcgm.md).",
    ),
    AgentOption("config", "--config", Path, CONFIG_HELP),
)  # fmt: skip

# The numbers parse_fast reads itself: plain decimals, which float() and typer's
# (pydantic's) number parsing read alike. Anything else ("1e3", " 1", "nan") is typer's.
_PLAIN_NUMBER = re.compile(r"[0-9]+(\.[0-9]+)?")


def parse_fast(args: Sequence[str]) -> dict[str, Any] | None:
    """The values typer would call :func:`serve` with for ``args``, read without
    importing typer (why: ``gpuwatch.cli._serve_agent_without_typer``).

    Reads only what it can read exactly as typer's parser does: ``--name VALUE``,
    ``--name=VALUE`` (the last one given wins) and switches. Anything else (``--help``,
    an unknown option, a missing or bad value, an argument) returns ``None``, for the
    typer command to show its help or its error message and exit code.
    """
    by_flag: dict[str, tuple[AgentOption, bool]] = {}
    for option in OPTIONS:
        on, _, off = option.flags.partition("/")
        by_flag[on] = (option, True)
        if off:
            by_flag[off] = (option, False)
    values: dict[str, Any] = {option.name: None for option in OPTIONS}
    rest = iter(args)
    for arg in rest:
        flag, equals, attached = arg.partition("=")
        if flag not in by_flag:
            return None
        option, switch = by_flag[flag]
        if option.kind is bool:
            if equals:
                return None  # typer: "does not take a value"
            values[option.name] = switch
            continue
        # Like typer's parser, the next argument is the value even if it starts with "-".
        raw = attached if equals else next(rest, None)
        if raw is None or (option.kind is float and not _PLAIN_NUMBER.fullmatch(raw)):
            return None
        values[option.name] = option.kind(raw)
    return values


def register(app: typer.Typer) -> None:
    app.command(name="agent")(typer_command(serve))


def typer_command(run: Callable[[dict[str, Any]], None]) -> Callable[..., None]:
    """A function typer reads as the ``agent`` command, its parameters :data:`OPTIONS`,
    that calls ``run`` with their values by name."""
    import inspect

    import typer

    def agent(**values: Any) -> None:
        """Run the host agent: poll NVML and serve /metrics (systemd runs this)."""
        run(values)

    # typer reads a command's options from its signature: this one is built, not written.
    agent.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [
            inspect.Parameter(
                option.name,
                inspect.Parameter.KEYWORD_ONLY,
                default=typer.Option(None, option.flags, metavar=option.metavar, help=option.help),
                annotation=option.kind | None,
            )
            for option in OPTIONS
        ],
        return_annotation=None,
    )
    return agent


def serve(values: Mapping[str, Any]) -> None:
    """Run the agent until SIGTERM or SIGINT, with ``values`` keyed by the names in
    :data:`OPTIONS` (``None``: not given). Raises ``GpuwatchError`` (settings, a busy
    port, no NVML)."""
    from gpuwatch.settings import AgentSettings, load

    overrides = dict(values)
    use_config_file(overrides.pop("config"))
    settings = load(AgentSettings, **overrides)  # None: the file or environment decides
    check_startup(settings)
    from gpuwatch.agent.arenas import limit_malloc_arenas

    limit_malloc_arenas()  # before _build starts the first thread
    running = _build(settings)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: running.stop())
    print(f"gpuwatch agent: serving {running.exporter.url}/metrics", file=sys.stderr, flush=True)
    running.run()


def check_startup(settings: AgentSettings) -> None:
    """What would make the agent fail later, found now. Raises ``ConfigError``."""
    from gpuwatch.errors import ConfigError
    from gpuwatch.settings import parse_host_port

    if settings.server_url:
        from gpuwatch.agent.http_post import Endpoint

        # Refused now (ftp://, no host, port 99999, a host no request can name), not by
        # the reporter after the fake GPUs' stand-ins are up.
        Endpoint.parse(settings.server_url, "")
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
    # Only a port in use may be another agent; a name that does not resolve, an address
    # not on this host or a port below 1024 is not.
    if err.errno == errno.EADDRINUSE:
        reason += " (another gpuwatch agent?)"
    return f"cannot listen on {shown}: {reason}; choose --listen HOST:PORT"


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
