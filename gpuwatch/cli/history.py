"""``gpuwatch history``: ask the central server what held which GPU, and what went wrong.

Examples::

    gpuwatch history processes --host host-3 --gpu 2 --at 14:05
    gpuwatch history events --kind idle --since 7d
    gpuwatch history top-idle --since 7d

Times are local: ``14:05`` (the latest past 14:05), ``2026-12-01T14:05``, ``7d`` /
``12h`` / ``30m`` / ``90s`` / ``2w`` ago, or epoch seconds.
"""

from __future__ import annotations

import re
import sys
import time
from datetime import datetime, timedelta
from difflib import get_close_matches
from typing import TYPE_CHECKING, get_args

import typer

from gpuwatch.cli.tables import print_json, print_table
from gpuwatch.cli.times import epoch_or_iso

if TYPE_CHECKING:
    from gpuwatch.server.client import HistoryClient

history = typer.Typer(
    name="history", help="Query the central server's history.", no_args_is_help=True
)

_DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smhdw])$")
_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_CLOCK = re.compile(r"^(\d{1,2}):(\d{2})(?::(\d{2}))?$")
_GIB = 2**30

SERVER = typer.Option(
    None,
    "--server",
    metavar="URL",
    help="Server base URL (default: http:// + the server's listen setting).",
)
TOKEN = typer.Option(
    None, "--token", metavar="TOKEN", help="Read token (default GPUWATCH_SERVER_READ_TOKEN)."
)
JSON = typer.Option(False, "--json", help="Print JSON instead of a table.")
LIMIT = typer.Option(100, "--limit", min=1, max=10_000, help="Most rows to show.")
HOST = typer.Option(None, "--host", help="Hostname.")
GPU = typer.Option(None, "--gpu", min=0, max=63, help="GPU index on the host.")
USER = typer.Option(None, "--user", help="Unix user.")


def parse_when(value: str, *, now: datetime) -> float:
    """A user's time expression as epoch seconds, relative to ``now`` (aware, local).

    Raises :class:`typer.BadParameter` for anything else.
    """
    text = value.strip()
    if text == "now":
        return now.timestamp()
    if match := _DURATION.match(text):
        # Further back than 1970 is "everything": the server's times start there.
        return max(0.0, now.timestamp() - float(match.group(1)) * _UNIT_SECONDS[match.group(2)])
    if match := _CLOCK.match(text):
        hour, minute, second = (int(g or 0) for g in match.groups())
        try:
            when = now.replace(hour=hour, minute=minute, second=second, microsecond=0)
        except ValueError as err:
            raise typer.BadParameter(f"no such time of day: {value!r}") from err
        if when > now:
            when -= timedelta(days=1)  # "at 14:05" at 10:00 means yesterday's 14:05
        return when.timestamp()
    try:
        return epoch_or_iso(text)
    except ValueError as err:
        raise typer.BadParameter(
            f"{value!r} is not a time: use 14:05, 2026-12-01T14:05, 7d, 12h or epoch seconds"
        ) from err


def _time_option(value: str | None, option: str) -> float | None:
    """``value`` as epoch seconds; a bad one is a bad option value, exit 3 (a click
    BadParameter raised here names no parameter, and would be exit 2)."""
    from gpuwatch.errors import ConfigError

    try:
        return None if value is None else parse_when(value, now=datetime.now().astimezone())
    except typer.BadParameter as err:
        raise ConfigError(f"{option}: {err.message}") from None


def _range(since: str | None, until: str | None) -> tuple[float | None, float | None]:
    """``--since`` and ``--until`` as epoch seconds; :class:`ConfigError` when the range
    is empty (``--since 1h --until 7d``), which would list nothing and say nothing."""
    from gpuwatch.errors import ConfigError

    since_at, until_at = _time_option(since, "--since"), _time_option(until, "--until")
    if since_at is not None and until_at is not None and since_at > until_at:
        raise ConfigError(f"--since {since} is after --until {until}: nothing is in between")
    return since_at, until_at


def _kinds() -> tuple[str, ...]:
    from gpuwatch.server.events.schemas import EventKind

    return get_args(EventKind)


def _check_kind(value: str | None) -> str | None:
    kinds = _kinds()
    if value is not None and value not in kinds:
        raise typer.BadParameter(f"one of {', '.join(kinds)}")
    return value


def _say_if_cut(shown: int, more: bool, noun: str) -> None:
    """Say on stderr (``--json``'s output stays the API's list) that ``--limit`` cut the
    list: without it the oldest rows vanished without a word."""
    if more:
        print(
            f"gpuwatch: showing the newest {shown:,} {noun}; more match (raise --limit or"
            " narrow the filters)",
            file=sys.stderr,
        )


def _check_host(client: HistoryClient, host: str | None) -> None:
    """:class:`NotFound` (exit 8) when the server knows no host named ``host``: nothing
    matching on a mistyped or wrong-case name (hostnames are matched exactly) is not the
    same answer as a quiet host. Asked only when nothing matched."""
    from gpuwatch.errors import NotFound

    if host is None:
        return
    known = client.hostnames()
    if host in known:
        return
    alike = [name for name in known if name.casefold() == host.casefold()]
    alike = alike or get_close_matches(host, known, n=3)
    hint = f" (did you mean {' or '.join(alike)}?)" if alike else ""
    raise NotFound(f"the server has no host named {host!r}{hint}")


def _client(server: str | None, token: str | None) -> HistoryClient:
    from gpuwatch.server.client import HistoryClient
    from gpuwatch.settings import ServerSettings, load

    settings = load(ServerSettings)
    if server is None:
        host, port = settings.listen.rsplit(":", 1)
        server = f"http://{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{port}"
    if token is None and settings.read_token is not None:
        token = settings.read_token.get_secret_value()
    return HistoryClient(server, token=token)


@history.command("processes")
def processes(
    host: str | None = HOST,
    gpu: int | None = GPU,
    user: str | None = USER,
    at: str | None = typer.Option(None, "--at", help="What held the GPU at this time."),
    open_: bool = typer.Option(False, "--open", help="Only processes holding memory now."),
    limit: int = LIMIT,
    server: str | None = SERVER,
    token: str | None = TOKEN,
    as_json: bool = JSON,
) -> None:
    """Process lifetimes on GPUs, newest first."""
    when = _time_option(at, "--at")
    with _client(server, token) as client:
        # One more than shown: whether --limit cut the list.
        rows = client.processes(limit=limit + 1, host=host, gpu=gpu, user=user, at=when, open=open_)
        if not rows:
            _check_host(client, host)
    rows, more = rows[:limit], len(rows) > limit
    _say_if_cut(len(rows), more, "processes")
    if as_json:
        print_json(rows)
        return
    print_table(
        ["HOST", "GPU", "PID", "USER", "HELD", "PEAK", "FIRST SEEN", "UNTIL", "COMMAND"],
        [
            [
                p.hostname,
                str(p.gpu_index),
                str(p.pid),
                p.user or "?",
                _gib(p.current_bytes),
                _gib(p.peak_bytes),
                _local(p.first_seen_at),
                "running" if p.ended_at is None else _local(p.ended_at),
                p.command or p.name or "",
            ]
            for p in rows
        ],
        empty="no matching processes",
    )


@history.command("events")
def events(
    kind: str | None = typer.Option(
        None,
        "--kind",
        callback=_check_kind,
        help=f"{', '.join(_kinds()[:-1])} or {_kinds()[-1]}.",
    ),
    host: str | None = HOST,
    gpu: int | None = GPU,
    user: str | None = USER,
    since: str | None = typer.Option(None, "--since", help="e.g. 7d, or a time."),
    until: str | None = typer.Option(None, "--until", help="A time; default now."),
    open_: bool = typer.Option(False, "--open", help="Only conditions that still hold."),
    limit: int = LIMIT,
    server: str | None = SERVER,
    token: str | None = TOKEN,
    as_json: bool = JSON,
) -> None:
    """Events (orphaned, runaway, idle, ...), newest first."""
    since_at, until_at = _range(since, until)
    with _client(server, token) as client:
        rows = client.events(
            limit=limit + 1,  # one more than shown: whether --limit cut the list
            kind=kind,
            host=host,
            gpu=gpu,
            user=user,
            since=since_at,
            until=until_at,
            open=open_,
        )
        if not rows:
            _check_host(client, host)
    rows, more = rows[:limit], len(rows) > limit
    _say_if_cut(len(rows), more, "events")
    if as_json:
        print_json(rows)
        return
    print_table(
        ["STARTED", "KIND", "REASON", "HOST", "GPU", "PID", "USER", "HELD", "STATE", "SUMMARY"],
        [
            [
                _local(e.started_at),
                e.kind,
                e.reason,
                e.hostname,
                "-" if e.gpu_index is None else str(e.gpu_index),
                "-" if e.pid is None else str(e.pid),
                e.user or "-",
                _gib(e.held_bytes),
                "open" if e.open else f"ended {_local(e.ended_at)}",
                e.summary,
            ]
            for e in rows
        ],
        empty="no matching events",
    )


@history.command("top-idle")
def top_idle(
    since: str = typer.Option("7d", "--since", help="Start of the range (default 7d ago)."),
    until: str | None = typer.Option(None, "--until", help="End of the range; default now."),
    limit: int = typer.Option(10, "--limit", min=1, max=100, help="Most users to show."),
    server: str | None = SERVER,
    token: str | None = TOKEN,
    as_json: bool = JSON,
) -> None:
    """Users ranked by GPU memory held while idle (GiB x hours)."""
    since_at, until_at = _range(since, until)
    assert since_at is not None
    with _client(server, token) as client:
        rows = client.top_idle(since=since_at, until=until_at, limit=limit)
    if as_json:
        print_json(rows)
        return
    print_table(
        ["USER", "IDLE GiB x h", "EVENTS", "LARGEST"],
        [
            [
                r.user or "?",
                f"{r.held_byte_seconds / _GIB / 3600:.1f}",
                str(r.events),
                _gib(r.max_held_bytes),
            ]
            for r in rows
        ],
        empty="no idle holders in that range",
    )


def _gib(value: int | None) -> str:
    return "?" if value is None else f"{value / _GIB:.1f} GiB"


def _local(epoch: float | None) -> str:
    if epoch is None:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(epoch))


def register(app: typer.Typer) -> None:
    app.add_typer(history)
