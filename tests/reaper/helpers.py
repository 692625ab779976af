"""Building blocks the reaper tests share: history driven by polls, plans, executors."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from gpuwatch.agent.reaper.audit import AuditLog
from gpuwatch.agent.reaper.events import Actor
from gpuwatch.agent.reaper.execute import Executor
from gpuwatch.agent.reaper.history import ProcessHistory
from gpuwatch.agent.reaper.killer import Killer
from gpuwatch.agent.reaper.plan import HeldLookup, IdleRule, Plan, make_plan
from gpuwatch.agent.reaper.policy import Protections, Selection
from gpuwatch.agent.reaper.procfs import ProcReader
from gpuwatch.agent.sampler import Sampler
from gpuwatch.snapshot import HostSnapshot
from gpuwatch.wire import ReportedEvent

MiB = 2**20
HOUR = 3600.0


def history(poll_interval: float = 30.0, **kwargs: float) -> ProcessHistory:
    return ProcessHistory(
        poll_interval_seconds=poll_interval,
        history_seconds=kwargs.pop("history_seconds", 86400.0),
        max_gap_seconds=kwargs.pop("max_gap_seconds", 600.0),
        max_runs=int(kwargs.pop("max_runs", 32)),
    )


def drive(
    sampler: Sampler,
    hist: ProcessHistory,
    clock: Callable[[], float],
    seconds: float,
    step: float = 30.0,
) -> HostSnapshot:
    """Poll every ``step`` seconds of the fake clock for ``seconds``; the last snapshot."""
    snapshot = sampler.poll()
    hist.observe(snapshot)
    end = clock() + seconds
    while clock() < end:
        clock.advance(step)  # type: ignore[attr-defined]
        snapshot = sampler.poll()
        hist.observe(snapshot)
    return snapshot


def plan_over(
    snapshot: HostSnapshot,
    hist: ProcessHistory | None,
    now: float,
    *,
    window: float = HOUR,
    caller_uid: int | None = None,
    protections: Protections | None = None,
    held_on: HeldLookup | None = None,
    **selection: object,
) -> Plan:
    return make_plan(
        snapshot,
        hist.runs_for if hist is not None else None,
        now=now,
        rule=IdleRule(window, 256 * MiB, 600.0, 0.9),
        selection=Selection(window_seconds=window, min_memory_bytes=256 * MiB, **selection),  # type: ignore[arg-type]
        protections=protections or Protections(),
        caller_uid=caller_uid,
        held_on=held_on,
    )


@dataclass
class Signals:
    """A pidfd_send_signal that records what it sent, then really sends it."""

    sent: list[tuple[int, str]] = field(default_factory=list)

    def __call__(self, fd: int, sig: int) -> None:
        self.sent.append((fd, signal.Signals(sig).name))
        signal.pidfd_send_signal(fd, sig)

    @property
    def names(self) -> list[str]:
        return [name for _, name in self.sent]


class SamplerObserver:
    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler

    def observe(self) -> HostSnapshot | None:
        return self.sampler.poll()


def executor(
    sampler: Sampler,
    audit_path: Path,
    *,
    grace: float = 5.0,
    signals: Signals | None = None,
    events: list[ReportedEvent] | None = None,
    caller_uid: int | None = None,
    protections: Protections | None = None,
    force: bool = False,
) -> Executor:
    return Executor(
        killer=Killer(
            ProcReader(),
            grace_seconds=grace,
            unkillable_seconds=5.0,
            send_signal=signals if signals is not None else Signals(),
        ),
        audit=AuditLog(audit_path),
        observer=SamplerObserver(sampler),
        protections=protections or Protections(),
        caller_uid=caller_uid,
        actor=Actor(uid=0, user="root", pid=1234, via="test"),
        run_id="run-1",
        verify_seconds=5.0,
        force=force,
        report=events.append if events is not None else None,
        monotonic=time.monotonic,
    )


def by_pid(done: subprocess.CompletedProcess[str]) -> dict[int, tuple[str, str]]:
    """``gpuwatch reap --json``'s candidates: pid -> (decision, reason)."""
    return {c["pid"]: (c["decision"], c["reason"]) for c in json.loads(done.stdout)["candidates"]}
