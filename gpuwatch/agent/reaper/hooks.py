"""The reaper's part of the running agent: history from every poll, served, and the
automatic policy when it is on. :class:`~gpuwatch.agent.service.Agent` holds one
:class:`ReaperHooks` and calls it from its poll loop, its HTTP endpoint and its OOM
relay; everything else stays here.
"""

from __future__ import annotations

import logging
import os
import pwd
import secrets
import time
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

from gpuwatch.agent.reaper.clock import SteadyClock, steady_clock
from gpuwatch.agent.reaper.history import ProcessHistory
from gpuwatch.agent.reaper.procfs import ProcReader
from gpuwatch.agent.reaper.served import history_report
from gpuwatch.agent.reaper.stats import PolicyCounts, PolicyStats
from gpuwatch.settings import AgentSettings
from gpuwatch.snapshot import HostSnapshot
from gpuwatch.wire import ReportedEvent

if TYPE_CHECKING:
    from gpuwatch.agent.reaper.auto import AutoReaper, NextPoll
    from gpuwatch.agent.reaper.execute import Executor
    from gpuwatch.agent.reaper.server_cache import CachedServerHistory

log = logging.getLogger(__name__)


class ReaperHooks:
    """History (always) and the automatic policy (when ``[agent.reap] enabled``).

    ``stats`` is the policy's counters (``None`` when it is off); they outlive a
    policy that could not start, which they count as ``policy_disabled``. ``clock`` is
    the reaper's steady clock (:mod:`gpuwatch.agent.reaper.clock`): every poll enters
    the history stamped with it, not with the snapshot's wall-clock time.
    ``boot_time`` is the btime the agent's start times are computed from, served with
    the history so that ``gpuwatch reap`` can match them after a wall-clock step.
    """

    def __init__(
        self,
        history: ProcessHistory,
        *,
        auto: AutoReaper | None = None,
        next_poll: NextPoll | None = None,
        clock: Callable[[], float] = time.time,
        stats: PolicyStats | None = None,
        boot_time: float | None = None,
    ) -> None:
        self.history = history
        self.auto = auto
        self.stats = auto.stats if auto is not None else stats
        self._next_poll = next_poll
        self._clock = clock
        self._boot_time = boot_time
        self._host = ("", "")

    @classmethod
    def build(
        cls,
        settings: AgentSettings,
        *,
        report: Callable[[ReportedEvent], object] | None,
        clock: Callable[[], float] = time.time,
    ) -> ReaperHooks:
        """The hooks for ``settings``; ``clock`` is the agent's wall clock (a test's fake
        clock is taken as steady as it is: :func:`~gpuwatch.agent.reaper.clock.steady_clock`)."""
        r = settings.reap
        procs = ProcReader(settings.proc_root)
        steady = steady_clock(clock)
        history = ProcessHistory(
            poll_interval_seconds=settings.poll_interval_seconds,
            history_seconds=max(r.history_seconds, r.idle_seconds + r.warn_before_seconds),
            max_gap_seconds=r.max_gap_seconds,
            max_runs=r.max_runs_per_process,
            cpu_busy_ratio=r.cpu_busy_ratio,
            cpu_seconds=procs.cpu_seconds,
            cpu_min_bytes=r.min_memory_bytes,
        )
        if not r.enabled:
            return cls(history, clock=steady, boot_time=procs.boot_time)
        return cls._with_policy(settings, history, procs, report=report, clock=clock, steady=steady)

    @classmethod
    def _with_policy(
        cls,
        settings: AgentSettings,
        history: ProcessHistory,
        procs: ProcReader,
        *,
        report: Callable[[ReportedEvent], object] | None,
        clock: Callable[[], float],
        steady: Callable[[], float],
    ) -> ReaperHooks:
        """Hooks with the automatic policy, or with its counters only if it cannot start.

        The policy's modules (and the detectors it judges idleness with) are imported
        here, only when it is on: the default agent does without them (0.6 MiB of RSS,
        bench/README.md "Agent RSS").
        """
        from gpuwatch.agent.reaper.audit import AuditLog
        from gpuwatch.agent.reaper.auto import AutoReaper, NextPoll
        from gpuwatch.agent.reaper.errors import AuditError
        from gpuwatch.agent.reaper.events import Actor
        from gpuwatch.agent.reaper.execute import Executor
        from gpuwatch.agent.reaper.killer import Killer
        from gpuwatch.agent.reaper.policy import Protections
        from gpuwatch.agent.reaper.procfs import job_key, may_signal_anyone

        r = settings.reap
        stats = PolicyStats()
        can_signal = may_signal_anyone(settings.proc_root)
        caller_uid = None if can_signal else os.geteuid()
        protections = Protections.from_settings(
            r, self_pids=(os.getpid(),), proc_root=settings.proc_root
        )
        # Up to three poll intervals for the next poll; a stuck poll loop is "no reading".
        next_poll = NextPoll(timeout_seconds=3 * settings.poll_interval_seconds + 1)
        uid = os.getuid()
        try:
            user = pwd.getpwuid(uid).pw_name
        except KeyError:
            user = str(uid)
        executor = Executor(
            killer=Killer(
                procs, grace_seconds=r.grace_seconds, unkillable_seconds=r.unkillable_seconds
            ),
            audit=AuditLog(r.audit_log, clock=clock),
            observer=next_poll,
            protections=protections,
            caller_uid=caller_uid,
            actor=Actor(uid=uid, user=user, pid=os.getpid(), via="agent policy"),
            run_id=secrets.token_hex(6),
            verify_seconds=r.verify_seconds,
            report=report,
            clock=clock,
        )
        try:
            # Fail now, not at the first stop: nothing is ever signalled without this log.
            executor.audit("policy_started", dry_run=r.dry_run or not can_signal, hostname="")
        except AuditError as err:
            log.error("reaper policy disabled: %s", err)
            stats.refused("policy_disabled")
            return cls(history, clock=steady, stats=stats, boot_time=procs.boot_time)
        _close_unfinished(executor)
        auto = AutoReaper(
            r,
            history=history,
            executor=executor,
            protections=protections,
            caller_uid=caller_uid,
            can_signal=can_signal,
            clock=steady,
            wall=clock,
            stats=stats,
            server=_server_history(settings, steady),
            job_of=partial(job_key, proc_root=settings.proc_root),
        )
        return cls(history, auto=auto, next_poll=next_poll, clock=steady, boot_time=procs.boot_time)

    def after_poll(self, snapshot: HostSnapshot) -> None:
        """Feed the history, wake a waiting stop, and let the policy check."""
        self._host = (snapshot.hostname, snapshot.boot_id)
        self.history.observe(snapshot, at=self._clock())
        if self._next_poll is not None:
            self._next_poll.offer(snapshot)
        if self.auto is not None:
            self.auto.after_poll(snapshot)

    def history_json(self, pid: int | None) -> bytes:
        """``GET /reaper/history``: :class:`~gpuwatch.agent.reaper.served.HistoryReport`."""
        hostname, boot_id = self._host
        offset = self._clock.offset if isinstance(self._clock, SteadyClock) else None
        report = history_report(
            self.history,
            hostname=hostname,
            boot_id=boot_id,
            generated_at=self._clock(),
            pid=pid,
            clock_offset_seconds=offset,
            boot_time=self._boot_time,
        )
        return report.model_dump_json().encode()

    def policy_counts(self) -> PolicyCounts | None:
        """What the policy did so far (``/metrics``); ``None`` when it is off."""
        return None if self.stats is None else self.stats.snapshot()

    def note_oom(self, gpu_index: int | None, pid: int, at: float) -> None:
        if self.auto is not None:
            self.auto.note_oom(gpu_index, pid, at)


def _close_unfinished(executor: Executor) -> None:
    """Record the policy's stops that an earlier agent began and never finished (it
    was killed mid-grace): each gets an ``interrupted`` outcome row and its event."""
    from gpuwatch.agent.reaper.errors import AuditError

    try:
        closed = executor.close_unfinished(executor.audit_log.recent())
    except AuditError as err:
        log.error("could not record the stops an earlier agent left unfinished: %s", err)
        return
    if closed:
        log.warning("recorded %d stop(s) an earlier agent left unfinished", closed)


# Short: the policy asks from the poll loop, and a hung server costs one timeout per
# retry period (gpuwatch.agent.reaper.server_cache).
_SERVER_TIMEOUT_SECONDS = 3.0


def _server_history(
    settings: AgentSettings, clock: Callable[[], float]
) -> CachedServerHistory | None:
    """The central server's history for the policy, when configured (else ``None``)."""
    r = settings.reap
    if not r.server_history or not settings.server_url:
        return None
    from gpuwatch.agent.reaper.server_cache import CachedServerHistory
    from gpuwatch.agent.reaper.server_reads import ServerReads  # only agents that use it

    token = None if r.server_read_token is None else r.server_read_token.get_secret_value()
    reads = ServerReads(
        str(settings.server_url), token=token, timeout_seconds=_SERVER_TIMEOUT_SECONDS
    )
    return CachedServerHistory(
        reads,
        server_url=str(settings.server_url),
        clock=clock,
        retry_min_seconds=r.check_interval_seconds,
    )
