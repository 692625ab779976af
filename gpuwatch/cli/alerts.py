"""``gpuwatch alerts``: see what fires, mute it for a while, and check that receivers work.

Examples::

    gpuwatch alerts list
    gpuwatch alerts silence add --match hostname=host-3 --match rule=~gpu_.* \\
        --for 2h --comment "driver upgrade"
    gpuwatch alerts silence list
    gpuwatch alerts silence expire 12
    gpuwatch alerts test-receiver team-a

Reads send the read token; changes (silences, receiver tests) the admin token, or the
read token where the server sets no admin token. Exit codes: docs/alerts-cli.md.
"""

from __future__ import annotations

import getpass
import re
import sys
import time
from typing import TYPE_CHECKING

import typer

from gpuwatch.cli.tables import print_json, print_table
from gpuwatch.cli.times import epoch_or_iso
from gpuwatch.errors import ConfigError, DeliveryFailed, NotFound
from gpuwatch.terminal_text import printable

if TYPE_CHECKING:
    from pydantic import ValidationError

    from gpuwatch.server.alerts.schemas import AlertOut, CulpritOut, MatcherIn, SilenceOut
    from gpuwatch.server.client import AlertsClient

alerts = typer.Typer(
    name="alerts",
    help="Alerts, silences and receivers of the central server.",
    no_args_is_help=True,
)
silence = typer.Typer(
    name="silence", help="Mute alerts matching labels for a while.", no_args_is_help=True
)
alerts.add_typer(silence)

_GIB = 2**30
_MIB = 2**20
_STATES = ("active", "firing", "pending", "resolved")
_ALERT_HEADERS = ("ID", "SEVERITY", "STATE", "RULE", "HOST", "GPU", "SINCE", "SILENCED")
_CULPRIT_HEADERS = ("USER", "PID", "MEMORY", "GROWTH", "COMMAND")
# A command is cut to this in the table (a 3,000-character command line printed as one
# enormous line); --json carries it whole. Users are cut as the server's receivers cut them.
_COMMAND_CHARS = 80
_USER_CHARS = 64
# What a receiver's name may hold (ReceiverConfig): anything else names no receiver.
_RECEIVER_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")

SERVER = typer.Option(
    None,
    "--server",
    metavar="URL",
    help="Server base URL (default: http:// + the server's listen setting).",
)
READ_TOKEN = typer.Option(
    None, "--token", metavar="TOKEN", help="Read token (default GPUWATCH_SERVER_READ_TOKEN)."
)
ADMIN_TOKEN = typer.Option(
    None,
    "--token",
    metavar="TOKEN",
    help="Admin token (default GPUWATCH_SERVER_ADMIN_TOKEN, else the read token).",
)
JSON = typer.Option(False, "--json", help="Print the API's JSON instead of a table.")


def _connect(server: str | None, token: str | None, *, admin: bool) -> AlertsClient:
    """A client of ``server`` sending ``token``; either one, when not given, from the
    server's settings (env vars, config file), as ``gpuwatch history`` does."""
    from gpuwatch.server.client import AlertsClient

    if server is None or token is None:
        from gpuwatch.settings import ServerSettings, load

        settings = load(ServerSettings)
        if server is None:
            host, port = settings.listen.rsplit(":", 1)
            server = f"http://{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{port}"
        if token is None:
            secret = (settings.admin_token if admin else None) or settings.read_token
            token = None if secret is None else secret.get_secret_value()
    return AlertsClient(server, token=token)


@alerts.command("list")
def list_alerts(
    state: str = typer.Option(
        "active", "--state", help="active (pending and firing), firing, pending or resolved."
    ),
    server: str | None = SERVER,
    token: str | None = READ_TOKEN,
    as_json: bool = JSON,
) -> None:
    """Alerts, most severe first, with the processes they blame."""
    if state not in _STATES:
        raise ConfigError(f"--state {state!r}: use one of {', '.join(_STATES)}")
    with _connect(server, token, admin=False) as client:
        rows, total = client.alerts(state=state)
    if total > len(rows):
        # Said on stderr, so --json's output stays the API's list.
        print(
            f"gpuwatch: showing {len(rows):,} of {total:,} {state} alerts, the most severe and"
            " oldest first (the server lists at most 1,000; narrow with --state)",
            file=sys.stderr,
        )
    if as_json:
        print_json(rows)
        return
    print_table(
        [*_ALERT_HEADERS, *_CULPRIT_HEADERS],
        [row for alert in rows for row in _alert_rows(alert)],
        empty=f"no {state} alerts",
    )


def _alert_rows(alert: AlertOut) -> list[list[str]]:
    """The alert on its first row, with its first culprit; one more row per culprit."""
    state: str = alert.state
    if alert.state == "resolved" and alert.ends_at is not None:
        state = f"resolved {_local(alert.ends_at)}"
    head = [
        str(alert.id),
        alert.severity,
        state,
        alert.rule,
        alert.labels.get("hostname", "-"),
        alert.labels.get("gpu", "-"),
        _local(alert.active_since),
        ",".join(str(s) for s in alert.silenced_by) or "-",
    ]
    culprits = [_culprit_cells(c) for c in alert.culprits] or [["-"] * len(_CULPRIT_HEADERS)]
    return [head + culprits[0]] + [[""] * len(head) + c for c in culprits[1:]]


def _culprit_cells(culprit: CulpritOut) -> list[str]:
    slope = culprit.slope_bytes_per_second
    return [
        _cut(culprit.user or "?", _USER_CHARS),
        str(culprit.pid),
        "?" if culprit.memory_bytes is None else _size(culprit.memory_bytes),
        "-" if not slope else f"{'+' if slope > 0 else '-'}{_size(abs(slope) * 60)}/min",
        _cut(culprit.command or "", _COMMAND_CHARS),
    ]


def _cut(text: str, limit: int) -> str:
    """One line of at most ``limit`` characters (control and bidi characters escaped,
    never cut inside an escape)."""
    from gpuwatch.server.notifications.receivers.text import shorten

    return shorten(text, limit)


@alerts.command("test-receiver")
def test_receiver(
    name: str = typer.Argument(..., help="The receiver's name, as configured."),
    server: str | None = SERVER,
    token: str | None = ADMIN_TOKEN,
) -> None:
    """Send a sample notification to a receiver once, and say how it went."""
    if _RECEIVER_NAME.fullmatch(name) is None and _utf8(name):
        # No receiver can have this name. Sent, a '/' in it ("x/../y") is decoded into
        # the path, and the server's 404 read as "not a gpuwatch server" (exit 5).
        raise NotFound(
            f"no receiver {printable(name)!r}: receiver names are letters, digits, '_', '.' and '-'"
        )
    with _connect(server, token, admin=True) as client:
        result = client.test_receiver(name)
    # The server's detail names the receiver and its answer, never the URL or secret:
    # "webhook receiver 'team-a': HTTP 404 no such hook".
    detail = printable(" ".join(result.detail.split()))
    if result.outcome == "sent":
        typer.echo(f"test notification sent: {detail}")
        return
    if result.outcome == "broken":
        raise DeliveryFailed(f"test notification refused for good: {detail}")
    raise DeliveryFailed(
        f"test notification failed: {detail} (notifications are retried until their deadline)"
    )


@silence.command("add")
def add_silence(
    match: list[str] = typer.Option(
        ...,
        "--match",
        metavar="LABEL=VALUE",
        help="LABEL=VALUE or LABEL=~REGEX (whole value); repeat: all must match.",
    ),
    for_: str | None = typer.Option(None, "--for", metavar="DURATION", help="e.g. 2h, 30m, 1d."),
    until: str | None = typer.Option(
        None, "--until", metavar="TIME", help="End: epoch seconds or 2026-12-01T18:00 (local)."
    ),
    comment: str = typer.Option(..., "--comment", help="Why (shown with the silence)."),
    by: str | None = typer.Option(None, "--by", metavar="NAME", help="Who (default $USER)."),
    server: str | None = SERVER,
    token: str | None = ADMIN_TOKEN,
    as_json: bool = JSON,
) -> None:
    """Mute alerts matching every --match, for a duration or until a time."""
    from pydantic import ValidationError

    from gpuwatch.server.alerts.schemas import SilenceIn

    if (for_ is None) == (until is None):
        raise ConfigError("give exactly one of --for DURATION and --until TIME")
    matchers = [parse_matcher(m) for m in match]
    try:
        body = SilenceIn(
            matchers=matchers,
            starts_at=None,
            duration_seconds=None if for_ is None else parse_duration(for_),
            ends_at=None if until is None else parse_until(until),
            created_by=_user() if by is None else by,
            comment=comment,
        )
    except ValidationError as err:
        raise ConfigError(_first_error(err, _OPTION_OF)) from None
    with _connect(server, token, admin=True) as client:
        created = client.create_silence(body)
    if as_json:
        print_json([created])
        return
    typer.echo(f"silence {created.id} mutes {_matchers(created)} until {_local(created.ends_at)}")


@silence.command("list")
def list_silences(
    expired: bool = typer.Option(False, "--expired", help="Include silences that have ended."),
    server: str | None = SERVER,
    token: str | None = READ_TOKEN,
    as_json: bool = JSON,
) -> None:
    """Active and future silences (and ended ones with --expired), latest end first."""
    with _connect(server, token, admin=False) as client:
        rows = client.silences(expired=expired)
    if as_json:
        print_json(rows)
        return
    print_table(
        ["ID", "STATE", "MATCHERS", "STARTS", "ENDS", "BY", "COMMENT"],
        [
            [
                str(s.id),
                s.state,
                _matchers(s),
                _local(s.starts_at),
                _local(s.ends_at),
                s.created_by,
                s.comment,
            ]
            for s in rows
        ],
        empty="no silences" if expired else "no active or pending silences",
    )


@silence.command("expire")
def expire_silence(
    silence_id: int = typer.Argument(..., metavar="ID", help="The silence's id.", min=1),
    server: str | None = SERVER,
    token: str | None = ADMIN_TOKEN,
) -> None:
    """End a silence now: what it muted is heard again at its group's next look."""
    with _connect(server, token, admin=True) as client:
        ended = client.expire_silence(silence_id)
    typer.echo(f"silence {ended.id} ({_matchers(ended)}) ended {_local(ended.ends_at)}")


def parse_matcher(text: str) -> MatcherIn:
    """``LABEL=VALUE`` (exact) or ``LABEL=~REGEX`` (whole value) as the API's matcher.

    Raises :class:`ConfigError` (one line) for anything else.
    """
    from pydantic import ValidationError

    from gpuwatch.server.alerts.schemas import MatcherIn

    name, sep, value = text.partition("=")
    if not sep or not name.strip():
        raise ConfigError(f"--match {text!r}: expected LABEL=VALUE or LABEL=~REGEX")
    regex = value.startswith("~")
    try:
        return MatcherIn(name=name.strip(), value=value[1:] if regex else value, regex=regex)
    except ValidationError as err:
        raise ConfigError(f"--match {text!r}: {_first_error(err)}") from None


def parse_duration(text: str) -> float:
    """``2h``, ``30m``, ``1h30m``, ``1d`` or seconds; more than 0. :class:`ConfigError` else."""
    from gpuwatch.quantities import parse_seconds

    try:
        seconds = parse_seconds(text)
    except ValueError as err:
        raise ConfigError(f"--for {text!r}: {err}") from None
    if seconds <= 0:
        raise ConfigError(f"--for {text!r}: a silence must last more than 0 seconds")
    return seconds


def parse_until(text: str) -> float:
    """Epoch seconds, or an ISO 8601 time (local when it names no zone), at most a year
    from now (as --for; the server refuses later ends too, by its own clock)."""
    from gpuwatch.server.alerts.schemas import MAX_SILENCE_SECONDS

    try:
        until = epoch_or_iso(text)
    except ValueError:
        raise ConfigError(
            f"--until {text!r}: use epoch seconds or a time such as 2026-12-01T18:00"
        ) from None
    if until > time.time() + MAX_SILENCE_SECONDS:
        raise ConfigError(f"--until {text!r}: a silence may end at most a year (365 days) from now")
    return until


# What a person typed, for each field of the API's SilenceIn.
_OPTION_OF = {
    "created_by": "--by",
    "comment": "--comment",
    "ends_at": "--until",
    "duration_seconds": "--for",
}


def _first_error(err: ValidationError, names: dict[str, str] | None = None) -> str:
    """The first problem pydantic found, on one line, naming the field (no input echoed)."""
    first = err.errors(include_input=False)[0]
    where = ".".join(str(part) for part in first["loc"])
    where = (names or {}).get(where, where)
    message = " ".join(str(first["msg"]).removeprefix("Value error, ").split())
    message = message.replace("Input should be", "must be", 1)  # gpuwatch's words, not pydantic's
    return f"{where}: {message}" if where else message


def _utf8(text: str) -> bool:
    """Whether ``text`` is valid UTF-8 (an argument that is not is the client's exit 3)."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def _user() -> str:
    try:
        return getpass.getuser()
    except (OSError, KeyError):
        raise ConfigError("cannot tell who you are: pass --by NAME") from None


def _matchers(s: SilenceOut) -> str:
    return ", ".join(f"{m.name}{'=~' if m.regex else '='}{m.value}" for m in s.matchers)


def _size(value: float) -> str:
    return f"{value / _GIB:.1f} GiB" if value >= _GIB else f"{value / _MIB:.0f} MiB"


def _local(epoch: float | None) -> str:
    if epoch is None:
        return "-"
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(epoch))
    except (OverflowError, OSError, ValueError):
        # A silence an older server stored "until 1e30": one odd cell, not a listing
        # that fails for everyone.
        return "out of range"


def register(app: typer.Typer) -> None:
    app.add_typer(alerts)
