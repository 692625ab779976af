"""The alert engine's settings: ``[server.alerts]`` in the server's config file.

Every table refuses unknown keys, and durations are written as ``"30s"``, ``"5m"``,
``"4h"`` or a number of seconds, so a typo is a one-line error at start rather than a
rule that silently never fires. Defaults and their reasons: docs/alerts.md.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

from gpuwatch.quantities import parse_bytes, parse_seconds

Duration = Annotated[float, BeforeValidator(parse_seconds)]
Bytes = Annotated[int, BeforeValidator(parse_bytes)]
Severity = Literal["info", "warning", "critical"]
SEVERITIES = ("info", "warning", "critical")
# The reaper's stages a process_reaped alert can carry (its ``stage`` label).
STAGES = ("warning", "withdrawn", "stopped", "failed", "dry_run", "refused")
# The labels whose values make a group (and its group_key) unless group_by says otherwise.
DEFAULT_GROUP_BY = ("rule", "hostname")
# Labels an alert can carry; group_by and route matchers may name only these.
LABELS = ("rule", "severity", "hostname", "gpu", "pid", "user", "team", "stage")
# Rules that announce something that happened (a job ended, a process was reaped):
# they fire once and resolve on their own, and their resolution is not notified.
ANNOUNCEMENTS = ("job_ended", "process_reaped")


class _Strict(BaseModel):
    # allow_inf_nan: "nan" passes no bound check, as in gpuwatch.settings._Base.
    model_config = ConfigDict(
        extra="forbid", frozen=True, populate_by_name=True, allow_inf_nan=False
    )


class RuleSettings(_Strict):
    """What every rule has; each rule's own thresholds are in its subclass.

    ``for`` is how long the condition must hold before the alert fires (pending
    until then); ``keep_firing_for`` keeps a firing alert firing that long after its
    condition stops holding, so a verdict that flickers does not resolve and re-fire.
    """

    enabled: bool = Field(True, description="Evaluate this rule.")
    for_seconds: Duration = Field(
        0.0, alias="for", description="The condition must hold this long before the alert fires."
    )
    keep_firing_for_seconds: Duration = Field(
        0.0,
        alias="keep_firing_for",
        description="A firing alert stays firing this long after its condition stops holding.",
    )
    severity: Severity = Field("warning", description="info, warning or critical (a label).")


class FillingUpRule(RuleSettings):
    """A GPU whose free memory is below ``free_ratio`` and whose trend (the
    ``filling_up`` verdict) reaches full within ``within``."""

    free_ratio: float = Field(0.25, gt=0, le=1, description="Free memory below this share.")
    within_seconds: Duration = Field(
        7200.0, alias="within", gt=0, description="The trend reaches full within this."
    )


class NearlyFullRule(RuleSettings):
    """A GPU that jumped to ``used_ratio`` or more: it was at least ``jump_ratio`` of
    its memory lower within ``jump_within``. For GPUs that jump rather than grow (the
    trend needs a window of growth); a GPU that sits full, flat, is its owner's steady
    state and raises nothing."""

    used_ratio: float = Field(0.95, gt=0, le=1, description="Used memory at or above this share.")
    jump_ratio: float = Field(
        0.2, gt=0, le=1, description="It rose by at least this share of its memory..."
    )
    jump_within_seconds: Duration = Field(
        900.0, alias="jump_within", gt=0, description="...within this long."
    )


class HeldRule(RuleSettings):
    """An event about a process (orphaned, idle) open at least ``held_for`` while the
    process holds at least ``min_memory``."""

    held_for_seconds: Duration = Field(
        1800.0, alias="held_for", description="The event has been open at least this long."
    )
    min_memory_bytes: Bytes = Field(
        1 * 2**30, alias="min_memory", description="The process holds at least this much."
    )


class IdleHolderRule(HeldRule):
    """Idle holders only matter on a GPU others need: used above ``contended_ratio``,
    or another user's process on the same GPU."""

    contended_ratio: float = Field(
        0.8, gt=0, le=1, description="The GPU counts as needed above this used share."
    )


class XidRule(RuleSettings):
    """The GPU reported a new Xid error (a driver-detected fault) within ``within``."""

    within_seconds: Duration = Field(
        900.0, alias="within", gt=0, description="A new Xid error this recent fires it."
    )


class ThrottleRule(RuleSettings):
    """The GPU is slowed by any of ``reasons`` (NVML's throttle reasons)."""

    reasons: list[str] = Field(
        default_factory=lambda: [
            "hw_slowdown",
            "hw_thermal_slowdown",
            "sw_thermal_slowdown",
            "hw_power_brake_slowdown",
        ],
        description="NVML throttle reasons that count (not the everyday sw_power_cap, gpu_idle).",
    )


class ReapedRule(RuleSettings):
    """The reaper acted (or, for ``warning``, will act) on a process: tell its owner and
    the channel. The alert fires for ``announce_for``, then resolves silently."""

    stages: list[str] = Field(
        default_factory=lambda: ["warning", "withdrawn", "stopped", "failed"],
        description="Reaper stages to announce (also: dry_run, refused).",
    )
    announce_for_seconds: Duration = Field(
        600.0, alias="announce_for", description="The alert fires this long, then resolves."
    )


class JobEndedRule(RuleSettings):
    """Opt-in per user or team: a process that held at least ``min_memory`` and was
    busy is gone. The alert fires once, for ``announce_for``, then resolves."""

    enabled: bool = Field(False, description="Off unless turned on (opt-in).")
    users: list[str] = Field(default_factory=list, description="Tell these users.")
    teams: list[str] = Field(default_factory=list, description="Tell users of these teams.")
    min_memory_bytes: Bytes = Field(
        1 * 2**30, alias="min_memory", description="Only processes that held this much."
    )
    announce_for_seconds: Duration = Field(
        600.0, alias="announce_for", description="The alert fires this long, then resolves."
    )


class Rules(_Strict):
    """The shipped rules, each overridable by name: ``[server.alerts.rules.<name>]``."""

    # Short `for`: the filling_up verdict already needs a window of growth evidence, and
    # every minute of `for` is a minute of warning lost (bench/README.md, alerts).
    gpu_filling_up_warning: FillingUpRule = FillingUpRule.model_validate(
        {"for": "1m", "keep_firing_for": "10m", "free_ratio": 0.25, "within": "2h"}
    )
    gpu_filling_up_critical: FillingUpRule = FillingUpRule.model_validate(
        {
            "for": "0s",
            "keep_firing_for": "10m",
            "free_ratio": 0.1,
            "within": "30m",
            "severity": "critical",
        }
    )
    gpu_nearly_full: NearlyFullRule = NearlyFullRule.model_validate(
        {"for": "5m", "keep_firing_for": "5m"}
    )
    orphaned_memory: HeldRule = HeldRule.model_validate({"held_for": "30m"})
    idle_holder: IdleHolderRule = IdleHolderRule.model_validate(
        {"held_for": "1h", "keep_firing_for": "5m", "severity": "info"}
    )
    runaway_process: RuleSettings = RuleSettings.model_validate(
        {"for": "5m", "keep_firing_for": "10m"}
    )
    gpu_lost: RuleSettings = RuleSettings.model_validate({"severity": "critical"})
    gpu_ecc_uncorrected: RuleSettings = RuleSettings.model_validate({"severity": "critical"})
    gpu_xid: XidRule = XidRule.model_validate({"severity": "critical"})
    gpu_throttled: ThrottleRule = ThrottleRule.model_validate(
        {"for": "5m", "keep_firing_for": "5m"}
    )
    gpu_memory_repair: RuleSettings = RuleSettings.model_validate({})
    agent_silent: RuleSettings = RuleSettings.model_validate({"for": "1m"})
    process_reaped: ReapedRule = ReapedRule.model_validate({"severity": "info"})
    job_ended: JobEndedRule = JobEndedRule.model_validate({"severity": "info"})

    @model_validator(mode="before")
    @classmethod
    def _merge_defaults(cls, data: Any) -> Any:
        # An override table changes only the keys it names: the other thresholds
        # keep the shipped values, not the class defaults.
        if not isinstance(data, dict):
            return data
        merged = {}
        for name, value in data.items():
            field = cls.model_fields.get(name)
            if field is None or not isinstance(value, dict):
                merged[name] = value
                continue
            default = field.default.model_dump(by_alias=True)
            merged[name] = {**default, **value}
        return merged


class Route(_Strict):
    """Which alerts go to ``receiver``: those of ``rules`` (all when empty) whose labels
    equal every ``match`` value. Without routes, every alert goes to every receiver."""

    receiver: str = Field(description="A [[server.receivers]] name.")
    rules: list[str] = Field(default_factory=list, description="Rule names; empty: all.")
    match: dict[str, str] = Field(
        default_factory=dict, description="label = value pairs an alert must carry."
    )

    @model_validator(mode="after")
    def _known(self) -> Route:
        unknown_rules = sorted(set(self.rules) - set(Rules.model_fields))
        if unknown_rules:
            raise ValueError(f"unknown rule(s) {', '.join(unknown_rules)}")
        unknown = sorted(set(self.match) - set(LABELS))
        if unknown:
            raise ValueError(f"unknown label(s) {', '.join(unknown)} (use {', '.join(LABELS)})")
        # Values too, where the set is known: a route matching severity "critcal" never
        # matched, and on-call never heard of a critical alert.
        severity = self.match.get("severity")
        if severity is not None and severity not in SEVERITIES:
            raise ValueError(
                f"match severity {severity!r}: not a severity (use {', '.join(SEVERITIES)})"
            )
        rule = self.match.get("rule")
        if rule is not None and rule not in Rules.model_fields:
            raise ValueError(f"match rule {rule!r}: no such rule (use rules = [...] for several)")
        if rule is not None and self.rules and rule not in self.rules:
            raise ValueError(f"match rule {rule!r} is not among its rules: it can never match")
        stage = self.match.get("stage")
        if stage is not None and stage not in STAGES:
            raise ValueError(f"match stage {stage!r}: not a stage (use {', '.join(STAGES)})")
        return self


class AlertSettings(_Strict):
    """``[server.alerts]``: evaluation, grouping, routing, the user-to-team map, rules."""

    evaluation_interval_seconds: Duration = Field(
        15.0, alias="evaluation_interval", gt=0, description="How often rules are evaluated."
    )
    group_by: list[str] = Field(
        default_factory=lambda: list(DEFAULT_GROUP_BY),
        description="Alerts with the same values of these labels share one notification.",
    )
    group_wait_seconds: Duration = Field(
        30.0,
        alias="group_wait",
        description="A new group waits this long before its first notification (an alert resolved by then is never sent).",
    )
    group_interval_seconds: Duration = Field(
        300.0,
        alias="group_interval",
        gt=0,
        description="After its first notification, a group is looked at again this often.",
    )
    repeat_interval_seconds: Duration = Field(
        14400.0,
        alias="repeat_interval",
        gt=0,
        description="Alerts still firing, unchanged, are notified again after this long.",
    )
    delivery_deadline_seconds: Duration = Field(
        3600.0,
        alias="delivery_deadline",
        gt=0,
        description="A notification is retried (with backoff) until this long after it was due, then given up.",
    )
    delivery_lease_seconds: Duration = Field(
        120.0,
        alias="delivery_lease",
        gt=0,
        description="A notification being sent is not tried again, by this or another replica, for this long: a server killed mid-send sends it once more after the lease. Must exceed 3 x every receiver's timeout_seconds (an attempt's longest run).",
    )
    resolved_retention_seconds: Duration = Field(
        86400.0,
        alias="resolved_retention",
        gt=0,
        description="Resolved alerts are kept this long (history, and their resolved notification).",
    )
    external_url: str | None = Field(
        None,
        description="Where people reach this server (an absolute http:// or https:// URL); put in notifications as a link.",
    )
    teams: dict[str, str] = Field(
        default_factory=dict,
        description="user = team: alerts about a user's process carry a team label.",
    )
    routes: list[Route] = Field(
        default_factory=list,
        description="[[server.alerts.routes]]; without any, every alert goes to every receiver.",
    )
    rules: Rules = Field(
        default_factory=lambda: Rules.model_validate({}),
        description="[server.alerts.rules.NAME]: override a shipped rule's settings.",
    )

    @field_validator("external_url")
    @classmethod
    def _absolute_url(cls, value: str | None) -> str | None:
        # Alertmanager refuses an alert whose generatorURL is not a URI (422), so a
        # scheme-less value would fail every notification to it.
        if value is None:
            return None
        parts = urlsplit(value)
        if (
            parts.scheme not in ("http", "https")
            or not parts.netloc
            or any(c.isspace() for c in value)
        ):
            raise ValueError(
                "external_url must be an absolute http:// or https:// URL, such as"
                " https://gpuwatch.example.com/"
            )
        return value

    @model_validator(mode="after")
    def _group_by_known(self) -> AlertSettings:
        unknown = sorted(set(self.group_by) - set(LABELS))
        if unknown:
            raise ValueError(
                f"group_by: unknown label(s) {', '.join(unknown)} (use {', '.join(LABELS)})"
            )
        return self
