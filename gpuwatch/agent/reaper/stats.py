"""What the automatic policy did, counted for ``/metrics`` (``gpuwatch_reaper_*``).

The policy's thread and its stop worker count here; the exporter's threads read a
:class:`PolicyCounts` copy at scrape time
(:class:`~gpuwatch.agent.collectors.reaper.ReaperCollector`). Every label value
listed below is exported from the first scrape, at 0 until counted.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import get_args

from gpuwatch.agent.reaper.killer import Outcome

# Why a warning was withdrawn: the process is no longer idle (activity on the GPU or
# the host CPU, or its idleness can no longer be shown), its GPU is no longer
# contended, it exited or dropped below the memory floor, or its GPU cannot be read
# (lost, an NVML error: nothing is done on what cannot be seen).
WITHDRAWN_REASONS = ("not_idle", "uncontended", "gone", "gpu_unreadable")
# The executor's outcomes, and ``dry_run`` for a stop the policy only recorded.
STOP_OUTCOMES: tuple[str, ...] = (*get_args(Outcome), "dry_run")
# Why the policy did not act: a due stop deferred by a rate cap (counted at each check
# it waits), the policy turned off (audit log unwritable, host PIDs not visible, a PID
# namespace other than the one proc_root shows), or a
# stop that raised before its outcome (nothing is signalled without its audit row).
REFUSAL_REASONS = ("host_cap", "user_cap", "policy_disabled", "stop_error")


@dataclass(frozen=True)
class PolicyCounts:
    """A copy of the counters: warnings issued, withdrawn by reason, stops by outcome,
    refusals by reason, and the processes under a warning now."""

    warnings: int = 0
    withdrawn: dict[str, int] = field(default_factory=dict)
    stops: dict[str, int] = field(default_factory=dict)
    refusals: dict[str, int] = field(default_factory=dict)
    warned_now: int = 0


class PolicyStats:
    """Thread-safe counters of one agent's policy."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._warnings = 0
        self._withdrawn: Counter[str] = Counter()
        self._stops: Counter[str] = Counter()
        self._refusals: Counter[str] = Counter()
        self._warned_now = 0

    def warned(self) -> None:
        with self._lock:
            self._warnings += 1

    def withdrawn(self, reason: str) -> None:
        with self._lock:
            self._withdrawn[reason] += 1

    def stopped(self, outcome: str) -> None:
        with self._lock:
            self._stops[outcome] += 1

    def refused(self, reason: str) -> None:
        with self._lock:
            self._refusals[reason] += 1

    def under_warning(self, count: int) -> None:
        with self._lock:
            self._warned_now = count

    def snapshot(self) -> PolicyCounts:
        with self._lock:
            return PolicyCounts(
                warnings=self._warnings,
                withdrawn=dict(self._withdrawn),
                stops=dict(self._stops),
                refusals=dict(self._refusals),
                warned_now=self._warned_now,
            )
