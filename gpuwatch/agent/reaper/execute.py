"""Carry out a plan: audit every decision, then stop each chosen process and verify.

For each chosen process, in order: the ``decision`` rows of the whole plan are in the
audit log before anything else happens; the killer re-checks identity through a
pidfd and calls back here to confirm, on a *fresh* NVML observation, that the process
is still listed, still idle and still unprotected, and (``rejudge``) that the
history, read again *now*, still shows it idle for the whole window with nothing
since the plan: the time between the plan and the signal (a prompt, earlier
processes' grace periods) is judged like any other; a ``signal`` row is fsynced before
each signal, with the figures of that moment (memory held, idle stretch); after the
process is gone, NVML is read until it no longer lists the process (memory freed) or
``verify_seconds`` pass; an ``outcome`` row and a ``reaped`` event close it. A stop
cut short (Ctrl-C, SIGTERM, the agent stopping) still gets its ``outcome`` row,
``interrupted``, and, once a signal may have gone out, its event. A dry run writes the
decision rows and the events and sends nothing.
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from gpuwatch.agent.event_delivery import EventDelivery
from gpuwatch.agent.reaper.audit import AuditLog
from gpuwatch.agent.reaper.errors import PidfdUnproven
from gpuwatch.agent.reaper.events import Actor, describe, reaped_event
from gpuwatch.agent.reaper.evidence import IdleEvidence
from gpuwatch.agent.reaper.history import classify
from gpuwatch.agent.reaper.killer import GONE, Killer, KillReport, Target
from gpuwatch.agent.reaper.plan import Plan, unreadable_gpus
from gpuwatch.agent.reaper.policy import Candidate, Decision, Holding, Protections, protection
from gpuwatch.agent.reaper.procfs import same_start
from gpuwatch.snapshot import Gpu, GpuProcess, HostSnapshot
from gpuwatch.wire import ReportedEvent

log = logging.getLogger(__name__)


class Observer(Protocol):
    """A fresh look at the GPUs: a new NVML poll (the CLI) or the agent's next one."""

    def observe(self) -> HostSnapshot | None: ...


# The decision judged again from the history as it is now, given the memory held now
# (GPU index -> bytes): :func:`gpuwatch.agent.reaper.plan.rejudge` over a fresh read.
Rejudge = Callable[[Decision, dict[int, "int | None"]], Decision]
# Why the process need not be stopped any more, judged on the fresh reading right before
# its signal (``None``: still needed): the policy's contention, after the earlier stops of
# its batch freed memory.
StillNeeded = Callable[[Decision, HostSnapshot], "str | None"]


@dataclass
class Result:
    """What happened to one chosen process.

    ``outcome`` is a killer outcome (``terminated``, ``killed``, ``already_exited``,
    ``not_permitted``, ``identity_changed``, ``unkillable``, ``no_longer_eligible``,
    ``failed``) or ``dry_run``. ``memory_freed`` is whether NVML stopped listing it
    (``None``: not checked); ``seconds_to_freed`` runs from the start of the attempt.
    """

    pid: int
    outcome: str
    detail: str
    signals: list[str] = field(default_factory=list)
    memory_bytes: int = 0
    memory_freed: bool | None = None
    memory_freed_bytes: int | None = None
    seconds_to_freed: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "pid": self.pid,
            "outcome": self.outcome,
            "detail": self.detail,
            "signals": self.signals,
            "memory_bytes": self.memory_bytes,
            "memory_freed": self.memory_freed,
            "memory_freed_bytes": self.memory_freed_bytes,
            "seconds_to_freed": self.seconds_to_freed,
        }


def decision_row(decision: Decision) -> dict[str, Any]:
    """The per-process fields of an audit row."""
    c = decision.candidate
    return {
        "pid": c.pid,
        "start_time": c.start_time,
        "uid": c.uid,
        "user": c.user,
        "command": c.command,
        "gpus": c.gpus,
        "memory_bytes": c.memory_bytes,
        "idle_seconds": decision.idle_seconds,
        "verdict": decision.verdict,
        "reason": decision.reason,
        "detail": decision.detail,
    }


class Executor:
    """Runs plans. ``report`` takes each ``reaped`` event (the agent's sink or an
    :class:`~gpuwatch.agent.reaper.events.EventPoster`); ``None`` sends none."""

    def __init__(
        self,
        *,
        killer: Killer,
        audit: AuditLog,
        observer: Observer,
        protections: Protections,
        caller_uid: int | None,
        actor: Actor,
        run_id: str,
        verify_seconds: float,
        force: bool = False,
        report: Callable[[ReportedEvent], object] | None = None,
        rejudge: Rejudge | None = None,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self._killer = killer
        self.rejudge = rejudge
        self.still_needed: StillNeeded | None = None
        self._sending: list[EventDelivery] = []
        self._audit = audit
        self._observer = observer
        self._protections = protections
        self._caller_uid = caller_uid
        self._actor = actor
        self._run_id = run_id
        self._verify_seconds = verify_seconds
        self._force = force
        self._report = report
        self._clock = clock
        self._monotonic = monotonic
        self._sleep = sleep

    # -- audit -------------------------------------------------------------------------

    @property
    def audit_log(self) -> AuditLog:
        return self._audit

    def audit(self, event: str, *, dry_run: bool, hostname: str, **fields: Any) -> None:
        """Append one row (raises :class:`~gpuwatch.agent.reaper.errors.AuditError`)."""
        self._audit.write(
            {
                "run": self._run_id,
                "event": event,
                "host": hostname,
                "actor": self._actor.as_dict(),
                "dry_run": dry_run,
                **fields,
            }
        )

    def record(self, plan: Plan, *, dry_run: bool) -> None:
        """Write every decision of ``plan`` (spared ones too) to the audit log."""
        for decision in plan.decisions:
            self.audit(
                "decision", dry_run=dry_run, hostname=plan.hostname, **decision_row(decision)
            )

    def refuse(
        self, hostname: str, reason: str, *, dry_run: bool, decision: Decision | None = None
    ) -> None:
        """Record a refusal: an audit row and, for a named process, an event."""
        fields = decision_row(decision) if decision is not None else {}
        self.audit("refused", dry_run=dry_run, hostname=hostname, refusal=reason, **fields)
        if decision is not None:
            self.notify(
                decision,
                hostname,
                stage="refused",
                summary=f"gpuwatch reap refused to stop {describe(decision)}: {reason}",
                extra={"refusal": reason},
            )

    def signal_problem(self) -> str | None:
        """Why nothing can be signalled safely from here (``None``: it can): the
        killer's PID namespace check (:func:`~gpuwatch.agent.reaper.killer.namespace_problem`)."""
        return self._killer.signal_problem()

    # -- running -----------------------------------------------------------------------

    def run(self, plan: Plan, *, dry_run: bool, record: bool = True) -> list[Result]:
        """Audit the plan, then stop each chosen process (or, dry, say what would be)."""
        if record:
            self.record(plan, dry_run=dry_run)
        results = []
        for decision in plan.chosen:
            if dry_run:
                c = decision.candidate
                result = Result(
                    c.pid, "dry_run", "dry run: nothing sent", memory_bytes=c.memory_bytes
                )
                self.notify(
                    decision,
                    plan.hostname,
                    stage="dry_run",
                    summary=f"dry run: gpuwatch reap would stop {describe(decision)}, {decision.detail}",
                )
            else:
                result = self.stop(decision, plan.hostname)
            results.append(result)
        return results

    def stop(self, decision: Decision, hostname: str) -> Result:
        """Stop one chosen process and verify its memory was freed.

        The rows and the event carry the decision as judged at the recheck, right
        before the first signal (memory held then, idle stretch then). Interrupted
        (KeyboardInterrupt, SystemExit: Ctrl-C, SIGTERM), it writes an ``interrupted``
        outcome, and sends the event if a signal may have gone out, then re-raises."""
        c = decision.candidate
        started = self._monotonic()
        assert c.start_time is not None and c.uid is not None  # the policy spares unknowns
        target = Target(c.pid, c.start_time, c.uid)
        latest = [decision]  # the decision as the last recheck judged it
        signalled: list[str] = []  # signals whose row is written (maybe sent)

        def recheck() -> str | None:
            why, fresh = self._recheck(decision)
            latest[0] = fresh
            return why

        def before_signal(sig: signal.Signals) -> None:
            self.audit(
                "signal",
                dry_run=False,
                hostname=hostname,
                signal=sig.name,
                **decision_row(latest[0]),
            )
            signalled.append(sig.name)

        try:
            report = self._killer.stop(target, recheck=recheck, before_signal=before_signal)
        except PidfdUnproven as err:
            # Nothing was sent, and nothing will be from here: a refusal, not a stop cut short.
            self.refuse(hostname, str(err), dry_run=False, decision=latest[0])
            raise
        except BaseException:
            self._interrupted(latest[0], hostname, target, signalled)
            raise
        decision = latest[0]
        c = decision.candidate
        result = Result(c.pid, report.outcome, report.detail, report.signals, c.memory_bytes)
        if report.outcome in GONE:
            try:
                freed = self._wait_freed(c)
            except BaseException:
                self._interrupted(decision, hostname, target, report.signals)
                raise
            result.memory_freed = freed
            result.memory_freed_bytes = c.memory_bytes if freed else None
            result.seconds_to_freed = self._monotonic() - started if freed else None
        self.audit(
            "outcome",
            dry_run=False,
            hostname=hostname,
            outcome=result.outcome,
            outcome_detail=result.detail,
            signals=result.signals,
            memory_freed=result.memory_freed,
            memory_freed_bytes=result.memory_freed_bytes,
            **decision_row(decision),
        )
        self.notify(
            decision,
            hostname,
            stage="stopped" if report.outcome in GONE else "failed",
            summary=_summary(decision, report, result, self._actor),
            extra={
                "outcome": result.outcome,
                "outcome_detail": result.detail,
                "signals": result.signals,
                "memory_freed": result.memory_freed,
                "memory_freed_bytes": result.memory_freed_bytes,
            },
        )
        return result

    def close_unfinished(self, rows: list[dict[str, Any]]) -> int:
        """Record the stops of an earlier run of this actor (``via``) that were cut
        short without their outcome (the agent was killed mid-stop): an
        ``interrupted`` outcome row under that run, and the event. Returns how many."""
        count = 0
        for row in unfinished_stops(rows, via=self._actor.via):
            try:
                decision = _decision_from_row(row)
                target = Target(int(row["pid"]), float(row["start_time"]), int(row["uid"]))
            except (KeyError, TypeError, ValueError):
                continue
            gone = self._killer.gone(target)
            detail = (
                f"interrupted after {row.get('signal')} (the {self._actor.via} stopped "
                f"before the outcome); {'it has exited' if gone else 'it is still running'}"
            )
            self._audit.write(
                {
                    "run": row.get("run"),
                    "event": "outcome",
                    "host": row.get("host"),
                    "actor": self._actor.as_dict(),
                    "dry_run": False,
                    **decision_row(decision),
                    "outcome": "interrupted",
                    "outcome_detail": detail,
                    "signals": [row.get("signal")],
                    "memory_freed": None,
                    "memory_freed_bytes": None,
                }
            )
            self.notify(
                decision,
                str(row.get("host") or ""),
                stage="stopped" if gone else "failed",
                summary=f"{describe(decision)}: stop by {self._actor.via} {detail}",
                extra={"outcome": "interrupted", "outcome_detail": detail, "run": row.get("run")},
            )
            count += 1
        return count

    def _interrupted(
        self, decision: Decision, hostname: str, target: Target, signalled: list[str]
    ) -> None:
        """Close a stop that was cut short: an ``interrupted`` outcome row and, when a
        signal may have gone out, the event. Best effort: the interruption stands."""
        if signalled:
            gone = self._killer.gone(target)
            state = "it has exited" if gone else "it was still running"
            detail = f"interrupted after {', '.join(signalled)}; {state}"
        else:
            gone, detail = False, "interrupted before any signal; nothing was sent"
        try:
            self.audit(
                "outcome",
                dry_run=False,
                hostname=hostname,
                outcome="interrupted",
                outcome_detail=detail,
                signals=signalled,
                memory_freed=None,
                memory_freed_bytes=None,
                **decision_row(decision),
            )
        except Exception:  # the audit log went away mid-stop: say so, do not mask the cause
            log.exception("could not record the interrupted stop of pid %s", target.pid)
        if signalled:
            self.notify(
                decision,
                hostname,
                stage="stopped" if gone else "failed",
                summary=f"{describe(decision)}: stop by {self._actor.via} ({self._actor.who}) {detail}",
                extra={"outcome": "interrupted", "outcome_detail": detail, "signals": signalled},
            )

    def _recheck(self, decision: Decision) -> tuple[str | None, Decision]:
        """Why ``decision``'s process must not be signalled now, from a fresh
        observation and (``rejudge``) the history read again (``None``: go), and the
        decision with the figures of now."""
        c = decision.candidate
        snapshot = self._observer.observe()
        if snapshot is None:
            return "no fresh NVML reading to confirm it is still idle", decision
        # Every GPU it held memory on at plan time, not only those still listing it: on
        # one lost since, it may be busy and its memory there could never be seen freed.
        unreadable = unreadable_gpus(snapshot, c.holdings)
        if unreadable:
            return (
                f"gpu{unreadable[0]} cannot be read now (lost, an NVML error, or no longer "
                "listed): nothing is done on what cannot be seen"
            ), decision
        entries = _entries(snapshot, c, alive_only=True)
        if not entries:
            return "NVML no longer lists it: it holds no GPU memory now", decision
        used_now = _used_by_gpu(entries)
        fresh = replace(
            decision,
            candidate=replace(
                c,
                holdings=tuple(
                    replace(h, used_bytes=used_now.get(h.gpu_index, h.used_bytes))
                    for h in c.holdings
                ),
            ),
        )
        if not self._force:
            for gpu, process in entries:
                if classify(process, gpu) != "idle":
                    return f"no longer idle on gpu{gpu.index}", fresh
            if self.rejudge is not None:
                fresh = self.rejudge(decision, used_now)
                if fresh.verdict != "reap":
                    return f"no longer idle enough to stop: {fresh.detail}", fresh
        why = self._still_allowed(c, entries)
        if why is None and self.still_needed is not None:
            why = self.still_needed(fresh, snapshot)
        return why, fresh

    def _still_allowed(self, c: Candidate, entries: list[tuple[Gpu, GpuProcess]]) -> str | None:
        """Why the fresh facts of ``c`` protect it or make it not the caller's."""
        process = entries[0][1]
        fresh = Candidate(
            pid=c.pid,
            start_time=process.start_time,
            uid=process.owner.uid,
            user=process.owner.user,
            name=process.name,
            command=process.command,
            holdings=c.holdings,
            owner=process.owner,
        )
        protected = protection(fresh, self._protections)
        if protected is not None:
            return protected[1]
        if self._caller_uid is not None and fresh.uid != self._caller_uid:
            return "not the caller's process"
        return None

    def _wait_freed(self, c: Candidate) -> bool:
        """Read NVML until it stops listing ``c`` (True) or ``verify_seconds`` pass."""
        deadline = self._monotonic() + self._verify_seconds
        while True:
            snapshot = self._observer.observe()
            if snapshot is not None and not _entries(snapshot, c, alive_only=False):
                return True
            if self._monotonic() >= deadline:
                log.warning("NVML still lists pid %s after it exited", c.pid)
                return False
            self._sleep(0.1)

    def notify(
        self,
        decision: Decision,
        hostname: str,
        *,
        stage: str,
        summary: str,
        extra: dict[str, Any] | None = None,
    ) -> EventDelivery | None:
        """Hand a ``reaped`` event for ``decision`` to ``report`` (never raises).

        Returns its delivery when ``report`` answers with one (the agent's sink), for
        the policy to hold a stop until its warning has reached the server; ``None``
        when there is nothing to wait for (no server, or a synchronous poster)."""
        if self._report is None:
            return None
        event = reaped_event(
            decision,
            hostname=hostname,
            actor=self._actor,
            stage=stage,
            summary=summary,
            occurred_at=self._clock(),
            extra={"run": self._run_id, **(extra or {})},
        )
        try:
            handed = self._report(event)
        except Exception:  # a notification must never stop or undo a reap
            log.exception("could not hand over the reaped event for pid %s", event.pid)
            return None
        if isinstance(handed, EventDelivery):
            self._sending = [d for d in self._sending if d.pending] + [handed]
            return handed
        return None

    def flush(self, timeout_seconds: float) -> None:
        """Wait (at most ``timeout_seconds`` in all) for events still being sent in the
        background (the agent's sink sends them from a daemon thread, which an exiting
        agent would otherwise cut off)."""
        deadline = self._monotonic() + timeout_seconds
        for delivery in self._sending:
            delivery.join(max(0.0, deadline - self._monotonic()))
        self._sending = [d for d in self._sending if d.pending]


def unfinished_stops(rows: list[dict[str, Any]], *, via: str) -> list[dict[str, Any]]:
    """The last ``signal`` row of each stop by ``via`` (per run and PID) that no
    ``outcome`` row follows, oldest first."""
    open_rows: dict[tuple[Any, Any], dict[str, Any]] = {}
    for row in rows:
        actor = row.get("actor")
        if not isinstance(actor, dict) or actor.get("via") != via:
            continue
        key = (row.get("run"), row.get("pid"))
        if row.get("event") == "signal":
            open_rows[key] = row
        elif row.get("event") == "outcome":
            open_rows.pop(key, None)
    return list(open_rows.values())


def _decision_from_row(row: dict[str, Any]) -> Decision:
    """The decision an audit row records, enough for its event (raises on a bad row)."""
    gpus = [int(g) for g in row.get("gpus") or []] or [0]
    evidence = IdleEvidence(False, str(row.get("reason")), str(row.get("detail")),
                            idle_seconds=row.get("idle_seconds"))  # fmt: skip
    holdings = tuple(
        Holding(gpu_index=g, gpu_uuid="", used_bytes=int(row.get("memory_bytes") or 0) if i == 0 else 0,
                evidence=evidence)
        for i, g in enumerate(gpus)
    )  # fmt: skip
    candidate = Candidate(
        pid=int(row["pid"]),
        start_time=float(row["start_time"]),
        uid=int(row["uid"]),
        user=row.get("user"),
        name=None,
        command=row.get("command"),
        holdings=holdings,
    )
    return Decision(candidate, "reap", str(row.get("reason")), str(row.get("detail")))


def _used_by_gpu(entries: list[tuple[Gpu, GpuProcess]]) -> dict[int, int | None]:
    """GPU index -> bytes the process holds there now (``None``: not reported)."""
    used: dict[int, int | None] = {}
    for gpu, process in entries:
        if gpu.index in used:
            before = used[gpu.index]
            both = before is not None and process.used_bytes is not None
            used[gpu.index] = max(before, process.used_bytes) if both else None  # type: ignore[type-var]
        else:
            used[gpu.index] = process.used_bytes
    return used


def _entries(
    snapshot: HostSnapshot, c: Candidate, *, alive_only: bool
) -> list[tuple[Gpu, GpuProcess]]:
    """Where ``snapshot`` lists the same process as ``c`` (same PID and start time).

    A PID NVML lists after its process exited has no start time (``/proc`` has
    nothing left to read): it still counts as listed unless ``alive_only``, because
    its memory is not freed until NVML stops listing it.
    """
    return [
        (gpu, process)
        for gpu in snapshot.gpus
        for process in gpu.processes
        if process.pid == c.pid
        and (process.alive or not alive_only)
        and (process.start_time is None or same_start(process.start_time, c.start_time))
    ]


def _summary(decision: Decision, report: KillReport, result: Result, actor: Actor) -> str:
    what = describe(decision)
    if report.outcome == "already_exited" and not report.signals:
        free = "its memory is free" if result.memory_freed else "NVML still lists its memory"
        return f"{what} exited by itself before {actor.via} ({actor.who}) sent anything: {free}"
    if report.outcome in GONE:
        freed = (
            f"{result.memory_bytes / 2**30:.1f} GiB freed"
            if result.memory_freed
            else "NVML still lists its memory"
        )
        return f"{what} {report.outcome} by {actor.via} ({actor.who}): {freed}"
    return f"{actor.via} ({actor.who}) could not stop {what}: {report.outcome}, {report.detail}"
