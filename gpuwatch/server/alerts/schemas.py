"""API shapes of alerts, silences and receivers. Times are Unix epoch seconds."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

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


class MatcherIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(description=f"A label: {', '.join(LABELS)}.")
    value: str = Field(max_length=256)
    regex: bool = Field(False, description="value is a regular expression (whole match).")

    @model_validator(mode="after")
    def _check(self) -> MatcherIn:
        if self.name not in LABELS:
            raise ValueError(f"unknown label {self.name!r} (use {', '.join(LABELS)})")
        if self.regex:
            import re

            try:
                re.compile(self.value)
            except re.error as err:
                raise ValueError(f"bad regular expression {self.value!r}: {err}") from err
        return self


class SilenceIn(BaseModel):
    """A new silence: alerts matching every matcher are not notified until ``ends_at``
    (or for ``duration_seconds`` from now)."""

    model_config = ConfigDict(extra="forbid")

    matchers: list[MatcherIn] = Field(min_length=1, max_length=16)
    starts_at: float | None = Field(None, ge=0)
    ends_at: float | None = Field(None, ge=0)
    duration_seconds: float | None = Field(None, gt=0, le=365 * 86400)
    created_by: str = Field(min_length=1, max_length=256)
    comment: str = Field("", max_length=1024)

    @model_validator(mode="after")
    def _one_end(self) -> SilenceIn:
        if (self.ends_at is None) == (self.duration_seconds is None):
            raise ValueError("give exactly one of ends_at and duration_seconds")
        return self


class SilenceOut(BaseModel):
    id: int
    matchers: list[MatcherIn]
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


class TestResult(BaseModel):
    receiver: str
    outcome: Literal["sent", "retry", "broken"]
    detail: str
    status_code: int | None
