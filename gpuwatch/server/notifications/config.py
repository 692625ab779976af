"""Receiver configuration: the ``[[server.receivers]]`` tables of the server's config file.

::

    [[server.receivers]]
    name = "team-a"
    type = "slack"                    # slack | webhook | alertmanager
    url = "https://hooks.slack.com/services/T000/B000/XXXX"

    [[server.receivers]]
    name = "ops-hook"
    type = "webhook"
    url = "https://ops.example.com/gpuwatch"
    secret = "a long random string"   # HMAC-SHA256 key; required for webhook only

A receiver's ``url`` and ``secret`` are credentials (a Slack webhook URL is a bearer
token), so both are :class:`~pydantic.SecretStr`: ``repr()``, ``model_dump_json()`` and
validation errors never show them (``hide_input_in_errors``). Use :meth:`ReceiverConfig.public`
for anything a person or an API answer sees. A URL that cannot be reached is not a
configuration error; it becomes a ``retry`` or ``broken`` delivery outcome at run time.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    SecretStr,
    model_validator,
)

from gpuwatch.quantities import parse_seconds

ReceiverType = Literal["slack", "webhook", "alertmanager"]
# The most a receiver's timeout_seconds may be: callers waiting on one attempt (``alerts
# test-receiver``) wait this long plus a margin.
MAX_TIMEOUT_SECONDS = 60.0
Duration = Annotated[float, BeforeValidator(parse_seconds)]


class ReceiverConfig(BaseModel):
    """One notification receiver: where alerts of a route are sent, and how."""

    # hide_input_in_errors: a bad value (a URL with a typo, a misplaced secret) must
    # not be echoed into a ValidationError, a traceback or a log line.
    # allow_inf_nan: "nan" passes no bound check, as in gpuwatch.settings._Base.
    model_config = ConfigDict(
        extra="forbid", frozen=True, hide_input_in_errors=True, allow_inf_nan=False
    )

    name: str = Field(
        min_length=1,
        max_length=64,
        pattern=r"^[A-Za-z0-9_.-]+$",
        description="Unique receiver name (letters, digits, '_', '.', '-'); rules route to it.",
    )
    type: ReceiverType = Field(description="slack, webhook or alertmanager.")
    url: SecretStr = Field(
        description="Slack incoming-webhook URL, webhook endpoint, or Alertmanager base URL (http or https). A credential: never logged."
    )
    secret: SecretStr | None = Field(
        None,
        description="HMAC-SHA256 key signing webhook bodies (X-Gpuwatch-Signature). Webhook only, required there.",
    )
    send_resolved: bool = Field(True, description="Also notify when alerts resolve.")
    timeout_seconds: Duration = Field(
        10.0,
        gt=0,
        le=MAX_TIMEOUT_SECONDS,
        description="Bound on the whole of one attempt (connect, send, read), however slowly the receiver answers.",
    )

    @model_validator(mode="after")
    def _check(self) -> ReceiverConfig:
        label = self.label()
        # Imported here: the agent process loads these settings classes, not httpx.
        import httpx

        url = self.url.get_secret_value()
        # Never echo the URL: say what is wrong with it instead.
        try:
            parts = urlsplit(url)
            host, _ = parts.hostname, parts.port  # .port raises on a bad port
            httpx.URL(url)  # what the HTTP client will make of it
        except (ValueError, httpx.InvalidURL):
            raise ValueError(f"{label}: url is not a valid URL") from None
        if parts.scheme not in ("http", "https"):
            raise ValueError(f"{label}: url must start with http:// or https://")
        if not host:
            raise ValueError(f"{label}: url has no host")
        if any(c.isspace() for c in url):
            raise ValueError(f"{label}: url contains whitespace")
        if self.type == "webhook":
            if self.secret is None or not self.secret.get_secret_value():
                raise ValueError(f"{label}: a webhook receiver needs a secret (the HMAC key)")
        elif self.secret is not None:
            raise ValueError(f"{label}: secret is only for webhook receivers")
        return self

    def label(self) -> str:
        """How messages name this receiver: ``slack receiver 'team-a'`` (never the URL)."""
        return f"{self.type} receiver {self.name!r}"

    def public(self) -> dict[str, Any]:
        """What an API answer or a page may show: everything but the URL and secret."""
        return {
            "name": self.name,
            "type": self.type,
            "send_resolved": self.send_resolved,
            "timeout_seconds": self.timeout_seconds,
        }


def check_unique_names(receivers: list[ReceiverConfig]) -> list[ReceiverConfig]:
    """Refuse two receivers with one name (rules and the notification log refer to names)."""
    seen: set[str] = set()
    for receiver in receivers:
        if receiver.name in seen:
            raise ValueError(f"duplicate receiver name {receiver.name!r}")
        seen.add(receiver.name)
    return receivers


# The settings field type: ``receivers: ReceiverList = []`` in ServerSettings.
ReceiverList = Annotated[list[ReceiverConfig], AfterValidator(check_unique_names)]
