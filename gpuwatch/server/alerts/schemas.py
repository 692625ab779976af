"""API shapes of alerts, silences and receivers. Times are Unix epoch seconds."""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, Strict, StrictBool, model_validator

from gpuwatch.server.alerts import regex
from gpuwatch.server.alerts.config import LABELS


class CulpritOut(BaseModel):
    pid: int
    user: str | None
    command: str | None
    memory_bytes: int | None
    container_id: str | None = None
    pod_uid: str | None = None
    slurm_job_id: str | None = None
    slope_bytes_per_second: float | None = None


class AlertOut(BaseModel):
    """One alert. ``starts_at`` is when it fired (None while pending)."""

    id: int
    rule: str
    state: Literal["pending", "firing", "resolved"]
    severity: str
    labels: dict[str, str]
    summary: str
    description: str
    culprits: list[CulpritOut]
    active_since: float
    starts_at: float | None
    ends_at: float | None
    silenced_by: list[int] = Field(description="Ids of the silences muting it now.")


# Silence strings are shown in terminals and stored in text columns: no control
# characters (an escape sequence would reach an operator's terminal through
# `alerts silence list`; Postgres refuses NUL, which was a 500).
NO_CONTROL = r"^[^\x00-\x1f\x7f]*$"
# The longest silence, as `--for` allows: one year from now.
MAX_SILENCE_SECONDS = 365 * 86400.0
# Strict: a JSON true is not a number, nor "yes" a boolean; finite by construction.
_Seconds = Annotated[float, Strict(), Field(allow_inf_nan=False)]
_Text = Annotated[str, Strict(), Field(pattern=NO_CONTROL)]


class MatcherIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: _Text = Field(description=f"A label: {', '.join(LABELS)}.")
    value: _Text = Field(max_length=regex.MAX_PATTERN_CHARS)
    regex: StrictBool = Field(
        False,
        description="value is a regular expression (whole match), restricted to patterns"
        " that match in bounded time: no repeat of a repeat or of an alternation, at most"
        f" {regex.MAX_REPEATS} repeats, no backreferences or lookarounds.",
    )

    @model_validator(mode="after")
    def _check(self) -> MatcherIn:
        if self.name not in LABELS:
            raise ValueError(f"unknown label {self.name!r} (use {', '.join(LABELS)})")
        if self.regex:
            try:
                regex.check_pattern(self.value)
            except re.error as err:
                # The reason only: the pattern itself is not echoed back.
                raise ValueError(f"bad regular expression: {err.msg}") from None
            except regex.UnsafePattern as err:
                raise ValueError(f"regular expression refused: {err}") from None
        return self


class MatcherOut(BaseModel):
    """A stored matcher as it is, not validated again: a silence created before a
    check existed must still list (and can then be expired)."""

    name: str
    value: str
    regex: bool = False


class SilenceIn(BaseModel):
    """A new silence: alerts matching every matcher are not notified until ``ends_at``
    (or for ``duration_seconds`` from now), at most a year from now."""

    model_config = ConfigDict(extra="forbid")

    matchers: list[MatcherIn] = Field(min_length=1, max_length=16)
    starts_at: _Seconds | None = Field(None, ge=0)
    ends_at: _Seconds | None = Field(None, ge=0)
    duration_seconds: _Seconds | None = Field(None, gt=0, le=MAX_SILENCE_SECONDS)
    created_by: _Text = Field(min_length=1, max_length=256)
    comment: _Text = Field("", max_length=1024)

    @model_validator(mode="after")
    def _one_end(self) -> SilenceIn:
        if (self.ends_at is None) == (self.duration_seconds is None):
            raise ValueError("give exactly one of ends_at and duration_seconds")
        return self

    def span(self, now: float) -> tuple[float, float]:
        """(starts, ends) in epoch seconds at ``now``; :class:`SilenceRefused` unless it
        ends after it starts and within :data:`MAX_SILENCE_SECONDS` of ``now`` (a silence
        "until 1e308" never ended, and broke every listing of silences)."""
        starts = self.starts_at if self.starts_at is not None else now
        ends = self.ends_at if self.ends_at is not None else starts + (self.duration_seconds or 0)
        field = "ends_at" if self.ends_at is not None else "duration_seconds"
        if ends <= starts:
            raise SilenceRefused(field, "a silence must end after it starts")
        if ends > now + MAX_SILENCE_SECONDS:
            raise SilenceRefused(field, "a silence may end at most a year (365 days) from now")
        return starts, ends


class SilenceRefused(ValueError):
    """A well-formed silence the server will not store; ``field`` names the cause."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class SilenceOut(BaseModel):
    id: int
    matchers: list[MatcherOut]
    starts_at: float
    ends_at: float
    created_by: str
    comment: str
    created_at: float
    state: Literal["pending", "active", "expired"]


class ReceiverOut(BaseModel):
    """A configured receiver and how its deliveries went (never its URL or secret)."""

    name: str
    type: str
    status: Literal["ok", "broken", "failing", "unknown"]
    last_error: str | None
    last_sent_at: float | None
    pending: int
    # Notifications never sent because a newer one of their group replaced them
    # (kept as long as the notification log).
    superseded: int = 0
    # Notifications given up (their delivery deadline passed, attempted or not) since
    # the receiver last took one.
    failed: int = 0


class TestResult(BaseModel):
    receiver: str
    outcome: Literal["sent", "retry", "broken"]
    detail: str
    status_code: int | None
