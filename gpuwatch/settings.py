"""Typed settings, one object per process kind, built once at start-up and passed down.

Sources, highest priority first:

1. command-line options (passed to :func:`load` as overrides),
2. environment variables ``GPUWATCH_AGENT_*`` / ``GPUWATCH_SERVER_*``,
3. the TOML file named by ``GPUWATCH_CONFIG`` (default ``/etc/gpuwatch/gpuwatch.toml``),
   sections ``[agent]`` and ``[server]``,
4. the defaults below.

Only :func:`load` reads the environment and the file; a class constructed directly
takes the values it is given and the defaults (tests, the demo's own server). Nothing
else in gpuwatch reads ``os.environ`` for configuration. ``docs/configuration.md`` is
generated from these classes (``python -m gpuwatch.docs``), so the reference cannot drift.

The sources are merged here rather than by pydantic-settings: importing it costs the
agent process about 3.5 MiB (bench/README.md, "Agent RSS"), for the three sources
below.
"""

from __future__ import annotations

import json
import os
import tomllib
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)

from gpuwatch.agent.reaper.settings import ReapSettings
from gpuwatch.errors import ConfigError
from gpuwatch.server.alerts.config import AlertSettings
from gpuwatch.server.notifications.config import ReceiverList

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
    if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"expected HOST:PORT, got {value!r}")
    return host.strip("[]") or "0.0.0.0", int(port)


class _Base(BaseModel):
    # The TOML section and the environment variables' prefix (plus the setting's name
    # in upper case) of each kind.
    section: ClassVar[str]
    env_prefix: ClassVar[str]
    # validate_default: a default is checked like a given value.
    model_config = ConfigDict(extra="forbid", validate_default=True)


def _toml_section(kind: type[_Base]) -> dict[str, Any]:
    """The ``[section]`` of the config file for ``kind``; empty when there is no file."""
    path = Path(os.environ.get("GPUWATCH_CONFIG") or DEFAULT_CONFIG_FILE)
    if not path.is_file():
        return {}
    try:
        doc = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        raise ConfigError(f"cannot read config file {path}: {err}") from err
    section = doc.get(kind.section, {})
    if not isinstance(section, dict):
        raise ConfigError(f"{path}: [{kind.section}] must be a table")
    return section


def _environment(kind: type[_Base]) -> dict[str, Any]:
    """``kind``'s settings from ``PREFIX + NAME`` variables (any case). A table or list
    setting is written as JSON; the others are strings the field's type parses."""
    variables = {name.lower(): value for name, value in os.environ.items()}
    found: dict[str, Any] = {}
    for name, field in kind.model_fields.items():
        variable = kind.env_prefix + name.upper()
        value = variables.get(variable.lower())
        if value is None:
            continue
        if _is_structured(field.annotation):
            try:
                found[name] = json.loads(value)
            except ValueError as err:
                raise ConfigError(f"{variable} must be JSON: {err}") from err
        else:
            found[name] = value
    return found


def _is_structured(annotation: Any) -> bool:
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
        _is_structured(arg) for arg in typing.get_args(annotation) if arg is not type(None)
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

    listen: str = Field(
        default="127.0.0.1:9402",
        description="HOST:PORT of the /metrics and /snapshot HTTP endpoint.",
    )
    poll_interval_seconds: float = Field(
        default=5.0, gt=0, le=3600, description="Seconds between NVML polls."
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
        description="Where snapshots wait while the server is unreachable.",
    )
    spool_max_bytes: int = Field(
        default=64 * 2**20,
        ge=2**16,
        description="Spool size bound; the oldest snapshots are dropped (and counted) past it.",
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
    reap: ReapSettings = Field(
        default_factory=lambda: ReapSettings.model_validate({}),
        description="[agent.reap]: the reaper's idle rule, protections and automatic policy (off by default; docs/reaper.md).",
    )

    @field_validator("listen")
    @classmethod
    def _check_listen(cls, value: str) -> str:
        parse_host_port(value)
        return value

    @model_validator(mode="after")
    def _snapshot_token_given(self) -> AgentSettings:
        if self.snapshot_access == "token" and not (
            self.snapshot_token and self.snapshot_token.get_secret_value()
        ):
            raise ValueError("snapshot_access = token needs snapshot_token")
        return self


class ServerSettings(_Base):
    """Settings of ``gpuwatch server`` and the commands that talk to its database."""

    section: ClassVar[str] = "server"
    env_prefix: ClassVar[str] = "GPUWATCH_SERVER_"
    # hide_input_in_errors: receivers' URLs and secrets are credentials; a validation
    # error must not quote them.
    model_config = ConfigDict(extra="forbid", validate_default=True, hide_input_in_errors=True)

    listen: str = Field(
        default="127.0.0.1:9403", description="HOST:PORT the API and web dashboard listen on."
    )
    data_dir: Path = Field(
        default_factory=_default_data_dir, description="Directory for the default SQLite database."
    )
    database_url: str | None = Field(
        default=None,
        description="SQLAlchemy URL, e.g. postgresql+psycopg://user@host/db. Default: SQLite under data_dir.",
    )
    max_body_bytes: int = Field(
        default=8 * 2**20,
        ge=2**10,
        description="Largest accepted request body; larger ones get 413 unread.",
    )
    ingest_time_budget_seconds: float = Field(
        default=5.0,
        gt=0,
        le=3600,
        description="Time a snapshot push may take from its handler's start: past it before the database write starts, the push is answered 503 with Retry-After; past it midway, the snapshots done are committed and the rest answered 'deferred' (only to agents that send Gpuwatch-Partial). Half the agent's 10 s HTTP timeout, leaving the other half for the commit and the answer's way back.",
    )
    state_cache_hosts: int = Field(
        default=1024,
        ge=0,
        le=1_000_000,
        description="Hosts whose ingest state each server process keeps between pushes (about 40 KiB a host of 50 processes); 0 turns the cache off.",
    )
    retention_days: float = Field(
        default=30.0,
        gt=0,
        description="Samples and closed process lifetimes older than this are deleted.",
    )
    sample_interval_seconds: float = Field(
        default=60.0,
        gt=0,
        description="Downsampling step for stored per-process samples (trend evidence).",
    )
    agent_silent_intervals: int = Field(
        default=4, ge=1, description="An agent is 'silent' after this many missed push intervals."
    )
    idle_window_seconds: float = Field(
        default=3600.0, gt=0, description="No SM activity for this long makes a holder idle."
    )
    idle_min_bytes: int = Field(
        default=1 * 2**30, ge=0, description="Idle holders below this much memory are ignored."
    )
    runaway_share_ratio: float = Field(
        default=0.9,
        gt=0,
        le=1,
        description="A process above this share of a shared GPU's memory is runaway.",
    )
    leak_min_slope_bytes_per_second: float = Field(
        default=64 * 2**10,
        ge=0,
        description="Sustained growth above this rate is reported as a leak.",
    )
    scheduler: bool = Field(
        default=True,
        description="Run scheduled jobs in this process (one replica wins a Postgres advisory lock).",
    )
    read_token: SecretStr | None = Field(
        default=None,
        description="Bearer token the read API, /metrics and the web dashboard (as a bearer header or the sign-in form's cookie) require. Unset: reads are open (keep listen on localhost).",
    )
    agent_push_interval_seconds: float = Field(
        default=15.0,
        gt=0,
        le=3600,
        description="The agents' push interval; agent silence is counted in these.",
    )
    leak_min_duration_seconds: float = Field(
        default=1800.0,
        gt=0,
        description="Memory growth must last this long before it is reported as a leak.",
    )
    filling_horizon_seconds: float = Field(
        default=7200.0,
        gt=0,
        description="A GPU whose memory trend reaches full within this is 'filling up'.",
    )
    unattributed_min_bytes: int = Field(
        default=1 * 2**30,
        ge=0,
        description="GPU memory no listed process accounts for is reported above this.",
    )

    receivers: ReceiverList = Field(
        default_factory=list,
        description="Where alert notifications go: [[server.receivers]] tables (docs/alerts.md).",
    )
    alerts: AlertSettings = Field(
        default_factory=lambda: AlertSettings.model_validate({}),
        description="[server.alerts]: rules, thresholds, grouping, routes (docs/alerts.md).",
    )
    admin_token: SecretStr | None = Field(
        default=None,
        description="Bearer token for changes through the API (silences, receiver tests). Unset: they need the read token, like reads.",
    )

    @field_validator("listen")
    @classmethod
    def _check_listen(cls, value: str) -> str:
        parse_host_port(value)
        return value

    @model_validator(mode="after")
    def _routes_name_receivers(self) -> ServerSettings:
        names = {receiver.name for receiver in self.receivers}
        unknown = sorted({r.receiver for r in self.alerts.routes} - names)
        if unknown:
            raise ValueError(f"alerts.routes: unknown receiver(s) {', '.join(unknown)}")
        # One attempt can take a connect, a send and a read, each up to the timeout: a
        # lease shorter than that could let a second try start while the first runs.
        slow = [
            r.name
            for r in self.receivers
            if 3 * r.timeout_seconds >= self.alerts.delivery_lease_seconds
        ]
        if slow:
            raise ValueError(
                f"alerts.delivery_lease ({self.alerts.delivery_lease_seconds:g}s) must exceed 3 x the "
                f"timeout_seconds of receiver(s) {', '.join(slow)}"
            )
        return self

    def resolved_database_url(self) -> str:
        return self.database_url or f"sqlite:///{self.data_dir / 'gpuwatch.db'}"


S = TypeVar("S", bound=_Base)


def load(kind: type[S], **overrides: Any) -> S:
    """Build settings once from the file, the environment and ``overrides``; ``None``
    overrides are ignored so CLI defaults don't shadow env. Raises ConfigError."""
    given = {k: v for k, v in overrides.items() if v is not None}
    try:
        return kind.model_validate(_merged(_toml_section(kind), _environment(kind), given))
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        message = str(first["msg"]).removeprefix("Value error, ")
        if not where:  # a check across settings: its message names them
            raise ConfigError(f"invalid {kind.section} settings: {message}") from err
        raise ConfigError(f"invalid {kind.section} setting {where}: {message}") from err
