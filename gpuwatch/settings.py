"""Typed settings, one object per process kind, built once at start-up and passed down.

Sources, highest priority first:

1. command-line options (passed to :func:`load` as overrides),
2. environment variables ``GPUWATCH_AGENT_*`` / ``GPUWATCH_SERVER_*`` (a key of a table
   in :attr:`_Base.keyed_tables` also has its own, which wins over the table's JSON one),
3. the TOML file named by ``GPUWATCH_CONFIG`` (default ``/etc/gpuwatch/gpuwatch.toml``),
   sections ``[agent]`` and ``[server]``,
4. the defaults below.

A variable under those prefixes that names no setting is refused (exit 3,
:mod:`gpuwatch.settings_env`), as an unknown key of the file is.

Only :func:`load` reads the environment and the file; a class constructed directly
takes the values it is given and the defaults (tests, the demo's own server). Nothing
else in gpuwatch reads ``os.environ`` for configuration. ``docs/configuration.md`` is
generated from these classes (``python -m gpuwatch.docs``), so the reference cannot drift.

The sources are merged here rather than by pydantic-settings: importing it costs the
agent process about 3.5 MiB (bench/README.md, "Agent RSS"), for the three sources
below.

:class:`ServerSettings` is defined in :mod:`gpuwatch.server_settings` and imported from
here on first use (:func:`__getattr__`): the agent process never needs it, and it
brings the alert rules' and receivers' settings models with it, 0.7 MiB of the agent's
RSS (bench/README.md, "Agent RSS").
"""

from __future__ import annotations

import json
import os
import tomllib
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)

from gpuwatch.agent.reaper.settings import MIN_IDLE_POLLS, ReapSettings
from gpuwatch.errors import ConfigError
from gpuwatch.files import file_problem
from gpuwatch.host_origin import allowed_host_names
from gpuwatch.settings_env import refuse_unknown_variables

if TYPE_CHECKING:
    from gpuwatch.server_settings import ServerSettings as ServerSettings

DEFAULT_CONFIG_FILE = Path("/etc/gpuwatch/gpuwatch.toml")


def _default_data_dir() -> Path:
    # Root (the systemd units) keeps state under /var/lib; a user on a workstation
    # gets a per-user directory so `gpuwatch server` works without privileges.
    if os.geteuid() == 0:
        return Path("/var/lib/gpuwatch")
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "gpuwatch"


def parse_host_port(value: str) -> tuple[str, int]:
    """``"127.0.0.1:9402"`` -> ``("127.0.0.1", 9402)``; ``"[::1]:9402"`` works too.

    Port 0 asks the kernel for a free port (the agent prints the one it got).
    """
    host, sep, port = value.rpartition(":")
    # isascii: str.isdigit() is true for "١٢" and for 5,000 digits int() refuses.
    if not sep or not (port.isascii() and port.isdigit() and len(port) <= 5):
        raise ValueError(f"expected HOST:PORT, got {value!r}")
    if not 0 <= int(port) < 65536:
        raise ValueError(f"expected HOST:PORT, got {value!r}")
    host = host.strip("[]") or "0.0.0.0"
    try:
        # What socket.bind does with the name, so a name it cannot send is refused
        # here, as a setting, rather than as a TypeError or UnicodeError at bind.
        host.encode("idna")
    except UnicodeError:
        shown = host if len(host) <= 64 else host[:61] + "..."
        raise ValueError(f"expected HOST:PORT, {shown!r} is not a host name or address") from None
    return host, int(port)


class _Base(BaseModel):
    # The TOML section and the environment variables' prefix (plus the setting's name
    # in upper case) of each kind.
    section: ClassVar[str]
    env_prefix: ClassVar[str]
    # Table settings whose keys each have a variable of their own, PREFIX + TABLE_KEY
    # (GPUWATCH_AGENT_REAP_AUDIT_LOG). systemd lets EnvironmentFile= replace Environment=
    # whole: a secret key given as the table's JSON in the root-only env file would
    # silently drop the keys a drop-in sets through the same variable.
    keyed_tables: ClassVar[tuple[str, ...]] = ()
    # validate_default: a default is checked like a given value. allow_inf_nan: "nan"
    # passes no bound check of its own and was refused as "less than or equal to 3600",
    # or, with no upper bound, accepted ("inf" days of retention).
    model_config = ConfigDict(extra="forbid", validate_default=True, allow_inf_nan=False)


# The config file's tables: every process reads one file, whichever it needs.
CONFIG_SECTIONS = ("agent", "server")


def _toml_section(kind: type[_Base]) -> dict[str, Any]:
    """The ``[section]`` of the config file for ``kind``; empty when there is no file."""
    named = os.environ.get("GPUWATCH_CONFIG")
    path = Path(named or DEFAULT_CONFIG_FILE)
    problem = file_problem(path)
    # No file at the default path is no settings (a host configured by environment);
    # /dev/null, a device, reads as empty (GPUWATCH_CONFIG=/dev/null: tests and bench
    # use it to mean "none"). A file named on purpose that is missing, a directory, or a
    # name the system refuses was meant as a config file: skipping it would drop every
    # setting silently.
    if problem == "is not a regular file" or (problem == "does not exist" and not named):
        return {}
    if problem is not None:
        raise ConfigError(f"cannot read config file {path}: {problem}")
    try:
        doc = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        raise ConfigError(f"cannot read config file {path}: {err}") from err
    unknown = sorted(set(doc) - set(CONFIG_SECTIONS))
    if unknown:
        # A setting outside its table ("listen = ..." above [agent]) would be ignored.
        raise ConfigError(
            f"{path}: unknown top-level key {unknown[0]!r}: settings go in "
            + " or ".join(f"[{name}]" for name in CONFIG_SECTIONS)
        )
    section = doc.get(kind.section, {})
    if not isinstance(section, dict):
        raise ConfigError(f"{path}: [{kind.section}] must be a table")
    return section


def _environment(kind: type[_Base]) -> dict[str, Any]:
    """``kind``'s settings from ``PREFIX + NAME`` variables (any case). A table or list
    setting is written as JSON; the others are strings the field's type parses. A key of
    a keyed table set by its own variable wins over the same key in the table's JSON."""
    variables = {name.lower(): value for name, value in os.environ.items()}
    found: dict[str, Any] = {}
    for name, field in kind.model_fields.items():
        variable = kind.env_prefix + name.upper()
        value = variables.get(variable.lower())
        if value is not None:
            found[name] = _parsed(variable, value, field.annotation)
    for table, keys in _table_key_variables(kind).items():
        given = {
            key: _parsed(variable, variables[variable.lower()], annotation)
            for key, (variable, annotation) in keys.items()
            if variable.lower() in variables
        }
        table_json = found.get(table, {})
        # Not a table at all: left for validation to refuse, naming the setting.
        if given and isinstance(table_json, Mapping):
            found[table] = _merged(table_json, given)
    return found


def _parsed(variable: str, value: str, annotation: Any) -> Any:
    if not is_structured(annotation):
        return value
    try:
        return json.loads(value)
    except ValueError as err:
        raise ConfigError(f"{variable} must be JSON: {err}") from err


def _table_key_variables(kind: type[_Base]) -> dict[str, dict[str, tuple[str, Any]]]:
    """table -> key (as written in the file) -> (its own variable, the key's type)."""
    tables: dict[str, dict[str, tuple[str, Any]]] = {}
    for table in kind.keyed_tables:
        model = kind.model_fields[table].annotation
        assert isinstance(model, type) and issubclass(model, BaseModel), table
        tables[table] = {
            (field.alias or name): (
                f"{kind.env_prefix}{table.upper()}_{(field.alias or name).upper()}",
                field.annotation,
            )
            for name, field in model.model_fields.items()
        }
    return tables


def environment_variables(kind: type[_Base]) -> dict[str, str]:
    """Every variable ``kind`` reads -> the setting it sets (``reap.audit_log`` for a key
    of a keyed table)."""
    names = {kind.env_prefix + name.upper(): name for name in kind.model_fields}
    for table, keys in _table_key_variables(kind).items():
        names.update((variable, f"{table}.{key}") for key, (variable, _) in keys.items())
    return names


def is_structured(annotation: Any) -> bool:
    """A model, list or dict (possibly Optional or Annotated): set from JSON in the
    environment, as pydantic-settings did before."""
    while typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    origin = typing.get_origin(annotation)
    if origin in (list, dict, set, tuple):
        return True
    if isinstance(annotation, type) and issubclass(annotation, BaseModel | list | dict):
        return True
    return origin is not None and any(
        is_structured(arg) for arg in typing.get_args(annotation) if arg is not type(None)
    )


def _merged(*layers: Mapping[str, Any]) -> dict[str, Any]:
    """The layers, later ones winning; tables present in several are merged key by key
    (``[agent.reap]`` in the file and ``GPUWATCH_AGENT_REAP`` both count)."""
    out: dict[str, Any] = {}
    for layer in layers:
        for key, value in layer.items():
            if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
                out[key] = _merged(out[key], value)
            else:
                out[key] = value
    return out


class AgentSettings(_Base):
    """Settings of ``gpuwatch agent`` (and of ``gpuwatch status``, which polls once)."""

    section: ClassVar[str] = "agent"
    env_prefix: ClassVar[str] = "GPUWATCH_AGENT_"
    # GPUWATCH_AGENT_REAP_SERVER_READ_TOKEN in the root-only agent.env, beside the CAP_KILL
    # drop-in's GPUWATCH_AGENT_REAP_AUDIT_LOG (deploy/systemd/).
    keyed_tables: ClassVar[tuple[str, ...]] = ("reap",)

    listen: str = Field(
        default="127.0.0.1:9402",
        description="HOST:PORT of the /metrics and /snapshot HTTP endpoint.",
    )
    # The floor: NVML refreshes its utilisation samples about six times a second, so
    # polling faster reads the same figures again and only burns the host's CPU.
    poll_interval_seconds: float = Field(
        default=5.0, ge=0.1, le=3600, description="Seconds between NVML polls (0.1 to 3600)."
    )
    nvml_timeout_seconds: float = Field(
        default=2.0,
        gt=0,
        le=60,
        description="Bound on reading one GPU; a GPU whose NVML call hangs past it is reported as timed out and skipped while stuck.",
    )
    fake_gpus: str | None = Field(
        default=None,
        description="Scenario file (or bundled scenario name) to run on simulated GPUs instead of NVML.",
    )
    proc_root: Path = Field(
        default=Path("/proc"),
        description="Where /proc is mounted (a host /proc bind-mount in a container).",
    )
    process_metrics: bool = Field(
        default=False,
        description="Export per-process series (pid, user, container/pod/job labels). Opt-in: cardinality.",
    )
    process_metrics_max_series: int = Field(
        default=500,
        ge=0,
        le=100_000,
        description="Cap on per-process series per scrape; the largest holders are kept.",
    )
    dcgm_compat: bool = Field(
        default=False,
        description="Also export dcgm-exporter compatible DCGM_FI_* metrics, so NVIDIA's DCGM dashboards work unchanged (docs/dcgm.md).",
    )
    server_url: str | None = Field(
        default=None, description="Central server base URL; snapshots are pushed when set."
    )
    token: SecretStr | None = Field(
        default=None, description="Per-host bearer token for the central server."
    )
    push_interval_seconds: float = Field(
        default=15.0, gt=0, le=3600, description="Seconds between pushes to the server."
    )
    spool_dir: Path = Field(
        default_factory=lambda: _default_data_dir() / "spool",
        description="Where snapshots wait while the server is unreachable (default:"
        " /var/lib/gpuwatch/spool as root, else $XDG_DATA_HOME/gpuwatch/spool). One agent per"
        " directory: a second agent on it is refused at start (exit 3, naming the first's"
        " pid). It also keeps dropped_total, the drops of every run, which the server shows.",
    )
    spool_max_bytes: int = Field(
        default=64 * 2**20,
        ge=2**16,
        description="Spool size bound; the oldest snapshots are dropped (and counted) past it,"
        " or when the filesystem is full before it.",
    )
    agent_id: str | None = Field(
        default=None,
        description="Stable agent identity; defaults to /etc/machine-id, else hostname.",
    )
    hostname: str | None = Field(
        default=None,
        min_length=1,
        max_length=253,
        description="The hostname this agent reports (snapshots, the server's host list, the token's host); default: this machine's. For several simulated hosts on one machine (gpuwatch demo); give each its own agent_id too.",
    )
    # The HTTP port's bounds and access (gpuwatch.agent.port.PortPolicy).
    http_workers: int = Field(
        default=8,
        ge=1,
        le=64,
        description="Threads serving the HTTP port. Request heads are read without a thread; past 4 requests per worker in flight, new ones get 503.",
    )
    http_request_timeout_seconds: float = Field(
        default=10.0,
        gt=0,
        le=300,
        description="Longest one HTTP request may take, first byte to response; a slower client is cut off. Heads must arrive within min(5 s, this).",
    )
    http_max_waiting_connections: int = Field(
        default=256,
        ge=1,
        le=65536,
        description="Connections whose request has not fully arrived that are kept (no thread each); past it the oldest is closed.",
    )
    snapshot_access: Literal["loopback", "token", "open"] = Field(
        default="loopback",
        description="Who may GET /snapshot (every user's full command lines) and /reaper/history (every process's activity): loopback = this host only; token = also clients sending Authorization: Bearer <snapshot_token>; open = anyone who can connect.",
    )
    snapshot_token: SecretStr | None = Field(
        default=None,
        description="Bearer token for /snapshot from other hosts (snapshot_access = token).",
    )
    accept_oom_incidents: bool = Field(
        default=True,
        description="Accept OOM incidents POSTed by local processes (gpuwatch.torch) and forward them to the server. Any local user can post one over TCP loopback; each is marked reported_by agent-local with the poster's uid. false: refused with 403.",
    )
    allowed_hosts: list[str] = Field(
        default=[],
        description="Host names (or addresses) the HTTP port answers to besides localhost and loopback addresses, any port; '*' for any. On a loopback listen address other Host headers get 421, so a web page whose name re-resolves to 127.0.0.1 (DNS rebinding) cannot read /snapshot or post incidents; on another address any Host is answered unless this is set (then these names, localhost and IP addresses). Whatever the address, a POST a browser sends from another site (Origin, Sec-Fetch-Site) is refused 403, and an OOM incident not sent as application/json 415.",
    )
    reap: ReapSettings = Field(
        default_factory=lambda: ReapSettings.model_validate({}),
        description="[agent.reap]: the reaper's idle rule, protections and automatic policy (off by default; docs/reaper.md). Each key also has a variable of its own, GPUWATCH_AGENT_REAP_ plus the key in upper case (GPUWATCH_AGENT_REAP_SERVER_READ_TOKEN), which wins over the same key in GPUWATCH_AGENT_REAP: give the secret server_read_token that way in a root-only environment file (systemd: agent.env).",
    )

    @field_validator("listen")
    @classmethod
    def _check_listen(cls, value: str) -> str:
        parse_host_port(value)
        return value

    @field_validator("allowed_hosts")
    @classmethod
    def _check_allowed_hosts(cls, value: list[str]) -> list[str]:
        return allowed_host_names(value)

    @model_validator(mode="after")
    def _snapshot_token_given(self) -> AgentSettings:
        if self.snapshot_access == "token" and not (
            self.snapshot_token and self.snapshot_token.get_secret_value()
        ):
            raise ValueError("snapshot_access = token needs snapshot_token")
        return self

    @model_validator(mode="after")
    def _policy_idle_spans_polls(self) -> AgentSettings:
        # The policy judges idleness from this agent's own polls: the same floor as
        # ``gpuwatch reap --idle``, so the policy cannot stop a process on two samples.
        floor = MIN_IDLE_POLLS * self.poll_interval_seconds
        if self.reap.enabled and self.reap.idle_seconds < floor:
            raise ValueError(
                f"[agent.reap] idle ({self.reap.idle_seconds:g}s) must span at least "
                f"{MIN_IDLE_POLLS} poll intervals ({floor:g}s at poll_interval_seconds = "
                f"{self.poll_interval_seconds:g})"
            )
        return self


S = TypeVar("S", bound=_Base)


def load(kind: type[S], **overrides: Any) -> S:
    """Build settings once from the file, the environment and ``overrides``; ``None``
    overrides are ignored so CLI defaults don't shadow env. Raises ConfigError."""
    given = {k: v for k, v in overrides.items() if v is not None}
    # A misspelt variable would be ignored without a word (a secret's: reads left open).
    refuse_unknown_variables(kind.env_prefix, environment_variables(kind))
    try:
        return kind.model_validate(_merged(_toml_section(kind), _environment(kind), given))
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        message = str(first["msg"]).removeprefix("Value error, ")
        if not where:  # a check across settings: its message names them
            raise ConfigError(f"invalid {kind.section} settings: {message}") from err
        raise ConfigError(f"invalid {kind.section} setting {where}: {message}") from err


def __getattr__(name: str) -> Any:
    # ``from gpuwatch.settings import ServerSettings`` keeps working; only a process
    # that asks for it pays for it (the module docstring).
    if name == "ServerSettings":
        from gpuwatch.server_settings import ServerSettings

        return ServerSettings
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
