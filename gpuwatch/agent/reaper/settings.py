"""The reaper's settings: ``[agent.reap]`` in the config file (docs/reaper.md).

One table serves both ways of reaping: ``gpuwatch reap`` on the command line reads it
for its defaults and protections, and the agent's automatic policy runs on it when
``enabled`` is true (off by default). Durations are written ``"90s"``, ``"30m"``,
``"2h"``, ``"1d"`` or seconds; sizes ``"256MiB"``, ``"1GiB"`` or bytes. Unknown keys
are refused at start, so a misspelt protection is an error, never a silent no-op.

The protections here are the site's; no command-line flag turns them off.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, SecretStr, field_validator

from gpuwatch.quantities import parse_bytes, parse_seconds

Duration = Annotated[float, BeforeValidator(parse_seconds)]
Bytes = Annotated[int, BeforeValidator(parse_bytes)]

# Display servers and compositors hold graphics contexts on workstations; stopping
# one takes every user's session with it. Matched against the process name (comm).
DEFAULT_DISPLAY_SERVERS = (
    "Xorg",
    "X",
    "Xwayland",
    "gnome-shell",
    "kwin_wayland",
    "kwin_x11",
    "sway",
    "weston",
    "mutter",
    "plasmashell",
    "gdm-x-session",
    "sddm-greeter",
)


def default_audit_log() -> Path:
    """``/var/lib/gpuwatch/reap-audit.jsonl`` for root, else under the user's data dir.

    The same rule as the server's ``data_dir`` default: root (the systemd units)
    keeps state under /var/lib; a user running ``gpuwatch reap`` on their own
    processes gets a file they can write. The agent's drop-in sets the path itself.
    """
    if os.geteuid() == 0:
        return Path("/var/lib/gpuwatch/reap-audit.jsonl")
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "gpuwatch" / "reap-audit.jsonl"


_SLURM_JOB = re.compile(r"[0-9]{1,10}")
_POD_UID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")

# An idle window must span at least this many of the agent's poll intervals, for
# ``gpuwatch reap --idle`` and for the policy alike: a shorter one is a handful of
# samples (``--idle 1ms`` once reaped after two polls).
MIN_IDLE_POLLS = 5


class ReapSettings(BaseModel):
    """``[agent.reap]``: what counts as idle, how processes are stopped, who is protected,
    and the agent's automatic policy (``enabled``, off by default)."""

    # allow_inf_nan: "nan" passes no bound check, as in gpuwatch.settings._Base.
    model_config = ConfigDict(
        extra="forbid", frozen=True, populate_by_name=True, allow_inf_nan=False
    )

    # --- the automatic policy ---------------------------------------------------------
    enabled: bool = Field(
        False, description="Run the automatic policy in the agent (needs the CAP_KILL drop-in)."
    )
    dry_run: bool = Field(
        False,
        description="Policy test mode: warn and record what would be stopped, signal nothing.",
    )
    warn_before_seconds: Duration = Field(
        1800.0,
        alias="warn_before",
        ge=0,
        description="The policy warns the owner this long before stopping a process; 0: no warning step.",
    )
    contended_ratio: float = Field(
        0.9,
        gt=0,
        le=1,
        description="The policy acts only on a GPU at least this full (used / total) ...",
    )
    oom_wait_seconds: Duration = Field(
        900.0,
        alias="oom_wait",
        ge=0,
        description="... or on which another process hit an out-of-memory error this recently (someone is waiting).",
    )
    max_per_host_per_hour: int = Field(
        4, ge=0, le=1000, description="The policy stops at most this many processes per hour."
    )
    max_per_user_per_hour: int = Field(
        2, ge=0, le=1000, description="... and at most this many of one user's per hour."
    )
    check_interval_seconds: Duration = Field(
        60.0, alias="check_interval", gt=0, description="How often the policy looks."
    )
    server_history: bool = Field(
        True,
        description="The policy also reads the central server's samples (`[agent] server_url`) for a process the agent has watched for less than the window (after an agent restart); a server that cannot be read makes nothing idle.",
    )
    server_read_token: SecretStr | None = Field(
        None,
        description="Read token for those samples (the server's `read_token`; an agent token cannot read); unset: for a server that sets none. `gpuwatch reap` uses it when `[server] read_token` is unset.",
    )

    # --- what counts as idle ------------------------------------------------------------
    idle_seconds: Duration = Field(
        7200.0,
        alias="idle",
        gt=0,
        description="No GPU activity for this long makes a process idle (the policy's window; `gpuwatch reap --idle` gives its own). At least 5 of the agent's poll intervals.",
    )
    min_memory_bytes: Bytes = Field(
        256 * 2**20,
        alias="min_memory",
        ge=0,
        description="Only processes holding at least this much on some GPU are considered.",
    )
    coverage_ratio: float = Field(
        0.9,
        alias="coverage",
        gt=0,
        le=1,
        description="Share of the idle window the samples must cover; gaps are unknown time, never idle, and the idle clock restarts after each.",
    )
    max_gap_seconds: Duration = Field(
        600.0,
        alias="max_gap",
        gt=0,
        description="How long a process's history is kept across a gap in the samples, and how long a process not seen is remembered; every gap (agent down, polls failing) restarts the idle clock.",
    )
    cpu_busy_ratio: float = Field(
        0.1,
        alias="cpu_busy",
        ge=0,
        description="Host CPU use (cores) above this between two polls marks a GPU-idle process as working; 0 turns the CPU signal off.",
    )
    history_seconds: Duration = Field(
        86400.0,
        alias="history",
        gt=0,
        description="The agent's local history keeps this much (at least the longest window you reap with).",
    )
    max_runs_per_process: int = Field(
        32,
        ge=2,
        le=4096,
        description="Bound on stored activity runs per process and GPU; older runs are dropped (less idle, never more).",
    )

    # --- how processes are stopped --------------------------------------------------------
    grace_seconds: Duration = Field(
        30.0,
        alias="grace",
        ge=0,
        le=3600,
        description="SIGTERM, then this long to exit, then SIGKILL.",
    )
    unkillable_seconds: Duration = Field(
        10.0,
        alias="unkillable_after",
        gt=0,
        le=3600,
        description="A process still there this long after SIGKILL is reported unkillable (D state).",
    )
    verify_seconds: Duration = Field(
        10.0,
        alias="verify_for",
        ge=0,
        le=600,
        description="How long to wait for NVML to stop listing a stopped process (memory freed).",
    )
    audit_log: Path = Field(
        default_factory=default_audit_log,
        description="Append-only JSON-lines audit log, written and fsynced before every signal.",
    )

    # --- protections (no flag turns these off) ---------------------------------------------
    system_uid_max: int = Field(
        999,
        ge=0,
        description="Processes of uids up to this (root and system users) are never reaped.",
    )
    protected_users: list[str] = Field(
        default_factory=list, description="User names (or uids) never reaped."
    )
    protected_commands: list[str] = Field(
        default_factory=list,
        description="Regexes (Python syntax, searched in the command line) never reaped.",
    )
    protected_cgroups: list[str] = Field(
        default_factory=list,
        description="Regexes searched in the cgroup path; matches are never reaped.",
    )
    protected_slurm_jobs: list[str] = Field(
        default_factory=list, description="Slurm job ids whose processes are never reaped."
    )
    protected_pods: list[str] = Field(
        default_factory=list, description="Kubernetes pod UIDs whose processes are never reaped."
    )
    display_servers: list[str] = Field(
        default_factory=lambda: list(DEFAULT_DISPLAY_SERVERS),
        description="Process names (comm) of display servers, never reaped.",
    )

    @field_validator("protected_slurm_jobs")
    @classmethod
    def _job_ids(cls, ids: list[str]) -> list[str]:
        # Matched exactly against the number in the job's cgroup (job_<n>): anything
        # else would protect nobody, silently.
        for job in ids:
            if not _SLURM_JOB.fullmatch(job):
                raise ValueError(
                    f"{job!r} is not a Slurm job id: a number, as in the job's cgroup "
                    "(job_<n>; an array task has a job id of its own, not 1234_5)"
                )
        return ids

    @field_validator("protected_pods")
    @classmethod
    def _pod_uids(cls, uids: list[str]) -> list[str]:
        for uid in uids:
            if not _POD_UID.fullmatch(uid):
                raise ValueError(
                    f"{uid!r} is not a Kubernetes pod UID (lower-case, as "
                    "`kubectl get pod -o jsonpath={.metadata.uid}` prints it)"
                )
        return uids

    @field_validator("protected_commands", "protected_cgroups")
    @classmethod
    def _regexes_compile(cls, patterns: list[str]) -> list[str]:
        for pattern in patterns:
            try:
                re.compile(pattern)
            except re.error as err:
                raise ValueError(f"bad regex {pattern!r}: {err}") from None
        return patterns
