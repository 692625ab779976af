"""Settings of ``gpuwatch server`` (:class:`ServerSettings`), beside the agent's in
:mod:`gpuwatch.settings`, which imports this module only when ``ServerSettings`` is
asked for: the alert and receiver settings it holds cost the agent process 0.7 MiB of
RSS it never uses. Sources, precedence and :func:`gpuwatch.settings.load` are the same
for both kinds (see :mod:`gpuwatch.settings`).
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from pydantic import ConfigDict, Field, SecretStr, field_validator, model_validator

from gpuwatch.host_origin import allowed_host_names
from gpuwatch.server.alerts.config import AlertSettings
from gpuwatch.server.notifications.config import ReceiverList
from gpuwatch.settings import _Base, _default_data_dir, parse_host_port


class ServerSettings(_Base):
    """Settings of ``gpuwatch server`` and the commands that talk to its database."""

    section: ClassVar[str] = "server"
    env_prefix: ClassVar[str] = "GPUWATCH_SERVER_"
    # hide_input_in_errors: receivers' URLs and secrets are credentials; a validation
    # error must not quote them.
    model_config = ConfigDict(
        extra="forbid", validate_default=True, hide_input_in_errors=True, allow_inf_nan=False
    )

    listen: str = Field(
        default="127.0.0.1:9403", description="HOST:PORT the API and web dashboard listen on."
    )
    data_dir: Path = Field(
        default_factory=_default_data_dir,
        description="Directory for the default SQLite database. Default: /var/lib/gpuwatch as root, else $XDG_DATA_HOME/gpuwatch (~/.local/share/gpuwatch when XDG_DATA_HOME is unset).",
    )
    database_url: str | None = Field(
        default=None,
        # An empty value is refused, not read as "the default": `--database-url "$URL"`
        # with URL unset would otherwise put a fleet's history in a local SQLite file.
        min_length=1,
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
        description="Time a snapshot push may take from its handler's start: a body still arriving when it passes, or a push it passes before the database write starts, is answered 503 with Retry-After (a reported event's body must arrive within it too); past it midway, the snapshots done are committed and the rest answered 'deferred' (only to agents that send Gpuwatch-Partial). Half the agent's 10 s HTTP timeout, leaving the other half for the commit and the answer's way back.",
    )
    request_arrival_seconds: float = Field(
        default=10.0,
        gt=0,
        le=600,
        description="Time a request, head and body, may take to arrive, from its first byte (from the connection, for a connection's first request): past it the connection is answered 408 and closed. Bounds connections that send half a request, which anyone who can reach the port can open.",
    )
    state_cache_hosts: int = Field(
        default=4096,
        ge=0,
        le=1_000_000,
        description="Hosts whose ingest state each server process keeps between pushes (about 45 KiB a host of 50 processes: 180 MiB when full); 0 turns the cache off. A host not kept is read from the database on its next push, which at 3,000 hosts and 1,024 kept tripled the p99 of a push (bench/README.md, load).",
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
        description="Run the scheduled jobs in this process: agent silence, stale lifetimes, retention, and alert evaluation and delivery (each run, one replica wins a Postgres advisory lock). Off: none of them, alerts included.",
    )
    read_token: SecretStr | None = Field(
        default=None,
        description="Bearer token the read API, /metrics and the web dashboard (as a bearer header or the sign-in form's cookie) require. Unset: reads are open (keep listen on localhost). While admin_token is unset it also makes changes (silences, receiver tests). Empty, or equal to admin_token: the server refuses to start (exit 3).",
    )
    agent_push_interval_seconds: float = Field(
        default=15.0,
        gt=0,
        le=3600,
        description="The push interval of agents that do not report theirs (gpuwatch agents send it with every push); agent silence is counted in each host's own interval.",
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
        description="Bearer token for changes through the API (creating and expiring silences, receiver tests); it reads too, but not the dashboard's pages. Unset: changes need what reads need, the read token (nothing when read_token is unset too), so whoever holds the read token can silence every alert: set both (docs/server.md), to different tokens. Empty: the server refuses to start (exit 3).",
    )

    allowed_hosts: list[str] = Field(
        default=[],
        description="Host names (or addresses) the server answers to besides localhost and loopback addresses, any port; '*' for any. On a loopback listen address other Host headers get 421 (a web page whose name re-resolves to 127.0.0.1, DNS rebinding, cannot use the API); on another address any Host is answered unless this is set (then these names, localhost and IP addresses). Behind a reverse proxy, list the name browsers use: changes (POST, PUT, PATCH, DELETE) whose Origin is neither the request's own host and port nor one of these are refused 403.",
    )

    cookie_secure: bool | None = Field(
        default=None,
        description="Mark the dashboard's sign-in cookies Secure (sent over HTTPS only). Unset: Secure when alerts.external_url is https:// (the documented TLS reverse proxy, which the server sees as plain HTTP) or the request itself came over HTTPS. false: only the latter.",
    )

    @field_validator("read_token", "admin_token")
    @classmethod
    def _strip_token(cls, value: SecretStr | None) -> SecretStr | None:
        # Credentials are stripped before they are compared: spaces around a token
        # would make it one nobody can send. (An empty one is refused by `gpuwatch
        # server` at start; a client reading these treats it as none.)
        return None if value is None else SecretStr(value.get_secret_value().strip())

    def token_refusal(self) -> str | None:
        """Why the server must not start with these tokens (``None``: they are fine).

        An empty token (``GPUWATCH_SERVER_READ_TOKEN=`` uncommented) is a mistake the
        server would otherwise take as a token; one token for both roles makes every
        read-token holder an administrator, unannounced."""
        for name, token in (("read_token", self.read_token), ("admin_token", self.admin_token)):
            if token is not None and not token.get_secret_value():
                return f"{name} is empty: set a token, or leave it unset"
        read, admin = self.read_token, self.admin_token
        if (
            read is not None
            and admin is not None
            and read.get_secret_value() == admin.get_secret_value()
        ):
            return "admin_token equals read_token: give admin_token a token of its own"
        return None

    def cookies_secure(self) -> bool:
        """Whether the dashboard's cookies are Secure whatever scheme a request came by
        (``cookie_secure``; unset, an https ``alerts.external_url``)."""
        if self.cookie_secure is not None:
            return self.cookie_secure
        url = self.alerts.external_url
        return url is not None and url.lower().startswith("https://")

    @field_validator("allowed_hosts")
    @classmethod
    def _check_allowed_hosts(cls, value: list[str]) -> list[str]:
        return allowed_host_names(value)

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
