"""The agent's automatic policy: warn, then stop idle processes on contended GPUs.

Off by default (``[agent.reap] enabled``). Every ``check_interval`` the agent plans
over its own history, exactly as ``gpuwatch reap --idle <idle>`` would (with the
central server's samples for a process it has watched for less than the window, when
``server_history`` and ``[agent] server_url`` are set:
:mod:`gpuwatch.agent.reaper.server_cache`), and then, for each process the plan would
stop:

1. **Only on a contended GPU**: one at least ``contended_ratio`` full, or on which
   another process hit an out-of-memory error within ``oom_wait`` (someone is
   waiting). Idle memory on a GPU nobody needs is left alone. Any local user can post
   an OOM incident, so the agent counts one only from its process's owner (or root),
   for a live process NVML lists on that GPU, at the time the agent received it
   (``service.not_contention``). On a MIG GPU memory is partitioned: a process in a
   MIG instance is judged by its instance alone (its fullness, and OOMs in that
   instance), since stopping it frees memory for nobody else.
2. **Warning first**: the owner and the alert channel are told (a ``reaped`` event
   with ``stage: warning``, an audit row and a log line) "pid 4242 (alice, jupyter
   kernel, 11.0 GiB on gpu1) will be stopped in 30m unless it becomes active". With a
   server configured, nobody is stopped on a warning the server has not stored: while
   it is on its way (the server away, or answering 429), its ``warn_before`` starts
   again at every check, so the owner has at least ``warn_before`` less one
   ``check_interval`` after it arrives; one the server refuses for good, or the agent
   had to drop, is issued again at once (:meth:`AutoReaper._undelivered`).
3. **Spared on activity**: at every check a warned process is planned again; if it
   ran anything on the GPU (its idle stretch restarts), its GPU is no longer
   contended, it exited, or a GPU it held memory on can no longer be read (lost, an
   NVML error, not listed: ``gpu_unreadable``), the warning is withdrawn (``stage:
   withdrawn``).
4. **Stopped** at the first check after ``warn_before`` if it still qualifies and the
   rate caps allow (``max_per_host_per_hour``, ``max_per_user_per_hour``; a capped
   stop waits for the next check), by the same executor as ``gpuwatch reap``, in a
   worker thread so polls and ``/healthz`` carry on during the grace period. No check
   runs while a stop is in progress, so right before each signal the executor judges
   the process again from the history as it is then (:meth:`AutoReaper.rejudge`): a
   process of the batch that ran anything while an earlier one had its grace period is
   spared. The worker is not a daemon thread: an agent told to stop finishes the stop
   in progress (each later process of its batch is refused: no poll confirms it) and
   records it before it exits.

All its times (deadlines, rate caps, OOM ages, the history) are on the reaper's steady
clock (:mod:`gpuwatch.agent.reaper.clock`), so a wall-clock step neither shortens a
warning nor freezes the checks; ``wall`` is used only for times shown to people.

``dry_run`` (or an agent that lacks ``CAP_KILL``) warns and records "would stop"
without signalling anything.

What it did is counted in :class:`~gpuwatch.agent.reaper.stats.PolicyStats`, which the
agent exports as ``gpuwatch_reaper_*`` (docs/metrics.md).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gpuwatch.agent.event_delivery import EventDelivery
from gpuwatch.agent.reaper.central import ServerLookup, on_clock
from gpuwatch.agent.reaper.errors import ReapRefused
from gpuwatch.agent.reaper.events import describe
from gpuwatch.agent.reaper.evidence import format_duration
from gpuwatch.agent.reaper.execute import Executor, decision_row
from gpuwatch.agent.reaper.history import ProcessHistory
from gpuwatch.agent.reaper.plan import (
    CURRENT_POLLS,
    IdleRule,
    JobLookup,
    Plan,
    make_plan,
    rejudge,
    unreadable_gpus,
)
from gpuwatch.agent.reaper.policy import Decision, Protections, Selection
from gpuwatch.agent.reaper.server_cache import CachedServerHistory
from gpuwatch.agent.reaper.settings import ReapSettings
from gpuwatch.agent.reaper.stats import PolicyStats
from gpuwatch.snapshot import Gpu, HostSnapshot, MigInstance

log = logging.getLogger(__name__)

HOUR = 3600.0
# How long a stop waits for its events to reach the server (two tries with backoff).
_EVENT_FLUSH_SECONDS = 15.0
Key = tuple[int, float | None]  # (pid, start time): one process lifetime
# Where memory ran out: (GPU index, MIG GPU instance id), the id None for a whole GPU
# (not in MIG mode). A MIG instance's memory is its own: only its processes free any.
Place = tuple[int, int | None]


@dataclass
class PendingWarning:
    """A warning given to one process, and when it may be stopped (steady clock).

    ``issued`` is False when ``warn_before`` is 0: the process is due at once and
    nobody was told, so there is nothing to withdraw either."""

    decision: Decision
    warned_at: float
    deadline: float
    issued: bool = True
    # Its way to the server (None: no server to wait for, or not issued).
    delivery: EventDelivery | None = None
    held: bool = False  # logged once: its stop waits for the delivery


class AutoReaper:
    """Runs the policy; :meth:`after_poll` is called by the agent after every poll.

    ``executor`` stops processes (its observer waits for the agent's next poll; its
    ``rejudge`` is set to :meth:`rejudge`); ``clock`` is the reaper's steady clock, the
    one the history is stamped with, and ``wall`` the wall clock (epoch seconds, for
    what people read; by default ``clock`` itself). ``background`` runs stops on a
    worker thread (the
    agent); tests may run them inline. ``stats`` counts what it does (a fresh one
    when not given). ``server`` is the central server's history (``None``: the
    agent's alone decides). ``job_of`` links the ranks of one distributed job
    (:func:`~gpuwatch.agent.reaper.plan.make_plan`).
    """

    def __init__(
        self,
        settings: ReapSettings,
        *,
        history: ProcessHistory,
        executor: Executor,
        protections: Protections,
        caller_uid: int | None,
        can_signal: bool,
        clock: Callable[[], float] = time.time,
        wall: Callable[[], float] | None = None,
        background: bool = True,
        stats: PolicyStats | None = None,
        server: CachedServerHistory | None = None,
        job_of: JobLookup | None = None,
    ) -> None:
        self.settings = settings
        self.server = server
        self._job_of = job_of
        self.stats = stats if stats is not None else PolicyStats()
        self._history = history
        self._executor = executor
        self._protections = protections
        self._caller_uid = caller_uid
        self.dry_run = settings.dry_run or not can_signal
        if settings.enabled and not can_signal and not settings.dry_run:
            log.error(
                "[agent.reap] enabled, but the agent may not signal other users' processes "
                "(no CAP_KILL: install deploy/systemd/gpuwatch-agent-reap.conf); "
                "the policy only warns and records what it would stop"
            )
        self._clock = clock
        self._wall = clock if wall is None else wall
        self._background = background
        self._planned_at = 0.0  # when the plan of the batch being stopped was made
        self._planned_on = ""  # and for which host
        executor.rejudge = self.rejudge
        executor.still_needed = self.still_needed
        self.warnings: dict[Key, PendingWarning] = {}
        self._acted: set[Key] = set()
        self._stops: deque[tuple[float, str]] = deque()
        # Place (GPU index, MIG instance) -> pid -> when the agent received that
        # process's latest OOM there. Written from the agent's HTTP thread, read from
        # the poll loop.
        self._ooms: dict[Place, dict[int, float]] = {}
        self._ooms_lock = threading.Lock()
        self._next_check = 0.0
        self._worker: threading.Thread | None = None
        self._disabled = False
        # The processes of the batch in progress that its fresh readings found on a GPU
        # no longer contended (written and read on the stop worker only).
        self._uncontended: set[Key] = set()

    @property
    def busy(self) -> bool:
        """True while a stop is in progress on the worker thread."""
        return self._worker is not None and self._worker.is_alive()

    def note_oom(
        self, gpu_index: int | None, pid: int, at: float, *, gpu_instance_id: int | None = None
    ) -> None:
        """An out-of-memory error of ``pid`` on ``gpu_index`` (in its MIG GPU instance
        ``gpu_instance_id``; ``None``: the whole GPU): someone is waiting for memory
        there.

        The caller has checked that it may count (the agent: ``service.not_contention``).
        It counts only for processes in the same place: one without an instance on a
        GPU in MIG mode counts for nobody (every process there lives in one instance,
        and which one ran short is unknown). ``at`` is never later than this policy's
        clock, so no report can keep a GPU contended for longer than ``oom_wait``; one
        entry per process and place, pruned at every check (:meth:`_prune_ooms`), so
        the table stays bounded. ``at`` is the wall-clock time it was received; it is
        kept on the steady clock, as that long ago.
        """
        if gpu_index is None:
            return
        now = self._clock()
        at = now - max(0.0, self._wall() - at)
        with self._ooms_lock:
            seen = self._ooms.setdefault((gpu_index, gpu_instance_id), {})
            seen[pid] = max(at, seen.get(pid, at))

    def after_poll(self, snapshot: HostSnapshot) -> None:
        """Check now if a check is due (cheap otherwise). Never raises."""
        now = self._clock()
        if self._disabled or now < self._next_check or self.busy:
            return
        self._next_check = now + self.settings.check_interval_seconds
        try:
            self._check(snapshot, now)
        except ReapRefused as err:
            log.error("reaper policy disabled: %s", err)
            self._disabled = True
            self.stats.refused("policy_disabled")
        except Exception:  # the policy must never take the poll loop down
            log.exception("reaper policy check failed")

    def _check(self, snapshot: HostSnapshot, now: float) -> None:
        problem = None if self.dry_run else self._executor.signal_problem()
        if problem is not None:
            raise ReapRefused(problem)  # the policy is turned off (after_poll)
        self._prune_ooms(snapshot, now)
        plan = self._plan(snapshot, now)
        eligible: dict[Key, tuple[Decision, str]] = {}
        for decision in plan.chosen:
            why = self._contended(snapshot, decision, now)
            if why is not None:
                eligible[_key(decision)] = (decision, why)
        self._withdraw(snapshot, plan, eligible)
        due: list[Decision] = []
        for key, (decision, why) in eligible.items():
            warning = self.warnings.get(key)
            if key in self._acted:
                continue
            if warning is not None and _lost(warning):
                warning = None  # the owner was never told: tell them now
            if warning is None:
                warning = self._warn(plan, decision, why, now)
            if self._undelivered(warning, now):
                continue
            if now >= warning.deadline:
                due.append(decision)
        # Largest first: contention is judged again before each stop, so the fewest
        # processes are stopped when one stop frees enough.
        due.sort(key=lambda d: -d.candidate.memory_bytes)
        self._stop(plan, self._within_caps(due, now))
        self.stats.under_warning(sum(1 for w in self.warnings.values() if w.issued))

    def _plan(self, snapshot: HostSnapshot, now: float) -> Plan:
        s = self.settings
        return make_plan(
            snapshot,
            self._history.runs_for,
            now=now,
            rule=self._rule(),
            selection=Selection(window_seconds=s.idle_seconds, min_memory_bytes=s.min_memory_bytes),
            protections=self._protections,
            caller_uid=self._caller_uid,
            server=self._server_lookup(snapshot.hostname),
            held_on=self._history.gpus_for,
            job_of=self._job_of,
        )

    def _rule(self) -> IdleRule:
        s = self.settings
        return IdleRule(
            s.idle_seconds,
            s.min_memory_bytes,
            s.max_gap_seconds,
            s.coverage_ratio,
            # Its own history is current unless the poll loop is stuck.
            max_age_seconds=CURRENT_POLLS * self._history.poll_interval_seconds,
        )

    def _server_lookup(self, hostname: str) -> ServerLookup | None:
        """The server's history on the steady clock (``None``: not configured)."""
        if self.server is None:
            return None
        return on_clock(self.server.for_check(hostname), self._wall() - self._clock())

    def rejudge(self, decision: Decision, used_now: dict[int, int | None]) -> Decision:
        """``decision`` judged again from the history as it is now, right before its
        signal (:func:`~gpuwatch.agent.reaper.plan.rejudge`); called on the worker."""
        return rejudge(
            decision,
            self._history.runs_for,
            now=self._clock(),
            planned_at=self._planned_at,
            rule=self._rule(),
            used_now=used_now,
            server=self._server_lookup(self._planned_on),
        )

    def still_needed(self, decision: Decision, snapshot: HostSnapshot) -> str | None:
        """Contention judged again on the fresh reading right before ``decision``'s
        signal (called on the worker): an earlier stop of the same batch may have freed
        enough, and idle memory on a GPU nobody needs is left alone. ``None``: still
        contended, go on."""
        now = self._clock()
        self._prune_ooms(snapshot, now)
        if self._contended(snapshot, decision, now) is not None:
            return None
        self._uncontended.add(_key(decision))
        return "its GPU is no longer contended (earlier stops freed memory)"

    def _contended(self, snapshot: HostSnapshot, decision: Decision, now: float) -> str | None:
        """Why the memory the process holds somewhere is contended, or ``None``.

        Off MIG, its GPU: fullness and OOMs on the whole GPU. On a GPU in MIG mode, the
        MIG instance it runs in: that instance's fullness and OOMs in that instance only
        (stopping it frees memory there and nowhere else); where its instance is unknown,
        nothing there makes it contended."""
        for holding in sorted(decision.candidate.holdings, key=lambda h: h.gpu_index):
            index = holding.gpu_index
            gpu = snapshot.gpu(index)
            if gpu is None:
                continue
            place: Place
            if gpu.mig_instances:
                instance = _instance(gpu, holding.gpu_instance_id)
                if instance is None:
                    continue
                place = (index, instance.gpu_instance_id)
                where = f"MIG instance {instance.gpu_instance_id} of gpu{index}"
                full = _ratio(instance.memory_used_bytes, instance.memory_total_bytes)
            else:
                place = (index, None)
                where = f"gpu{index}"
                full = _ratio(gpu.memory_used_bytes, gpu.memory_total_bytes)
            if full is not None and full >= self.settings.contended_ratio:
                return f"{where} is {full:.0%} full"
            with self._ooms_lock:
                waiting = set(self._ooms.get(place, {}))  # pruned for ``now``: all recent
            if waiting - {decision.candidate.pid}:
                return f"another process ran out of memory on {where}"
        return None

    def _prune_ooms(self, snapshot: HostSnapshot, now: float) -> None:
        """Keep only OOMs within ``oom_wait`` of ``now`` in places the snapshot has: a
        GPU not in MIG mode (the whole GPU), or a MIG instance of one that is.

        Every place, not only those with a candidate: entries nothing reads would stay
        forever (a whole-GPU entry on a GPU in MIG mode is one nothing reads). One
        noted "later" than a check interval after ``now`` (the clock stepped back) is
        dropped too; within it, it may just have arrived during this check.
        """
        oldest = now - self.settings.oom_wait_seconds
        latest = now + self.settings.check_interval_seconds
        places = {place for gpu in snapshot.gpus for place in _places(gpu)}
        with self._ooms_lock:
            for place in list(self._ooms):
                recent = {pid: t for pid, t in self._ooms[place].items() if oldest <= t <= latest}
                if recent and place in places:
                    self._ooms[place] = recent
                else:
                    del self._ooms[place]

    def _warn(self, plan: Plan, decision: Decision, why: str, now: float) -> PendingWarning:
        wait = self.settings.warn_before_seconds
        warning = PendingWarning(decision, now, now + wait, issued=wait > 0)
        self.warnings[_key(decision)] = warning
        if not warning.issued:
            return warning
        self.stats.warned()
        deadline_epoch = warning.deadline + self._wall() - now
        summary = (
            f"{describe(decision)} will be stopped in {format_duration(wait)} unless it becomes active "
            f"({decision.detail}; {why})"
        )
        if self.dry_run:
            # Test mode (or no CAP_KILL): the owner must not read a threat that will never
            # be carried out as if it were real.
            summary = f"dry run, nothing will be stopped: {summary}"
        log.warning("%s", summary)
        self._executor.audit(
            "warning", dry_run=self.dry_run, hostname=plan.hostname, **decision_row(decision)
        )
        warning.delivery = self._executor.notify(
            decision,
            plan.hostname,
            stage="warning",
            summary=summary,
            extra={"deadline": deadline_epoch, "contention": why, "dry_run": self.dry_run},
        )
        return warning

    def _undelivered(self, warning: PendingWarning, now: float) -> bool:
        """True while ``warning`` is on its way to the server, so its process is not due.

        Any local user can keep the host's event budget busy, and a stop must never
        follow a warning nobody received: while it is pending its deadline moves to
        ``now + warn_before`` (one given up is issued again: :func:`_lost`)."""
        delivery = warning.delivery
        if delivery is None or not delivery.pending:
            return False
        if now >= warning.deadline and not warning.held:
            warning.held = True
            log.warning(
                "reaper: the warning for %s has not reached the server yet; "
                "it is not stopped until warn_before has passed since it did",
                describe(warning.decision),
            )
        warning.deadline = max(warning.deadline, now + self.settings.warn_before_seconds)
        return True

    def _withdraw(
        self, snapshot: HostSnapshot, plan: Plan, eligible: dict[Key, tuple[Decision, str]]
    ) -> None:
        decisions = {_key(d): d for d in plan.decisions}
        for key in list(self.warnings):
            if key in eligible:
                continue
            warning = self.warnings.pop(key)
            if not warning.issued:
                continue
            current = decisions.get(key)
            unreadable = _unreadable(snapshot, warning.decision, current)
            if unreadable:
                # Spared, or not in the plan at all, because a GPU it held memory on
                # cannot be read: not because it left or woke up.
                reason = "gpu_unreadable"
                why = f"gpu{unreadable[0]} cannot be read now (lost, or an NVML error)"
            elif current is None:
                reason, why = "gone", "it no longer holds the memory floor, or exited"
            elif current.verdict == "reap":
                reason, why = "uncontended", "its GPU is no longer contended"
            else:
                reason, why = "not_idle", f"it is spared now: {current.detail}"
            self._withdrawn(warning.decision, plan.hostname, reason, why)
        self._acted &= set(eligible)

    def _withdrawn(self, decision: Decision, hostname: str, reason: str, why: str) -> None:
        """Tell the owner and the log that the warning for ``decision`` is withdrawn."""
        self.stats.withdrawn(reason)
        summary = f"warning withdrawn: {describe(decision)} will not be stopped; {why}"
        log.info("%s", summary)
        self._executor.audit(
            "withdrawn",
            dry_run=self.dry_run,
            hostname=hostname,
            withdrawn_because=why,
            **decision_row(decision),
        )
        self._executor.notify(decision, hostname, stage="withdrawn", summary=summary)

    def _within_caps(self, due: Sequence[Decision], now: float) -> list[Decision]:
        while self._stops and self._stops[0][0] < now - HOUR:
            self._stops.popleft()
        allowed = []
        for decision in due:
            user = decision.candidate.user or str(decision.candidate.uid)
            per_user = sum(1 for _, u in self._stops if u == user)
            if len(self._stops) >= self.settings.max_per_host_per_hour:
                log.warning("reaper: host cap reached; %s waits", describe(decision))
                self.stats.refused("host_cap")
                continue
            if per_user >= self.settings.max_per_user_per_hour:
                log.warning("reaper: cap for user %s reached; %s waits", user, describe(decision))
                self.stats.refused("user_cap")
                continue
            self._stops.append((now, user))
            allowed.append(decision)
        return allowed

    def _stop(self, plan: Plan, decisions: list[Decision]) -> None:
        if not decisions:
            return
        warned: dict[Key, PendingWarning | None] = {}
        for decision in decisions:
            warned[_key(decision)] = self.warnings.pop(_key(decision), None)
            self._acted.add(_key(decision))
        batch = Plan(plan.now, plan.hostname, plan.boot_id, plan.window_seconds, decisions)
        self._planned_at, self._planned_on = plan.now, plan.hostname
        self._uncontended = set()

        def run() -> None:
            try:
                results = self._executor.run(batch, dry_run=self.dry_run, record=True)
            except ReapRefused as err:  # the killer cannot prove whom it would signal
                log.error("reaper policy disabled: %s", err)
                self._disabled = True
                self.stats.refused("policy_disabled")
                return
            except Exception:
                log.exception("reaper policy: stopping %d process(es) failed", len(decisions))
                self.stats.refused("stop_error")
                return
            for decision, result in zip(decisions, results, strict=True):
                self.stats.stopped(result.outcome)
                if result.outcome == "no_longer_eligible" and _key(decision) in self._uncontended:
                    self._spared_uncontended(decision, warned.get(_key(decision)), plan.hostname)
            # The events go out on daemon threads: an agent stopping right after this
            # stop must not cut them off (the worker itself is waited for at exit).
            self._executor.flush(_EVENT_FLUSH_SECONDS)

        if self._background:
            # Not a daemon: an agent told to stop (systemctl restart) finishes and records
            # the stop in progress before it exits, rather than dropping it mid-grace.
            self._worker = threading.Thread(target=run, name="gpuwatch-reaper", daemon=False)
            self._worker.start()
        else:
            run()

    def _spared_uncontended(
        self, decision: Decision, warning: PendingWarning | None, hostname: str
    ) -> None:
        """A process of the batch spared because its GPU was no longer contended when
        its turn came: its warning is withdrawn (``uncontended``), and the stop it was
        allowed under the rate caps is given back (nothing was stopped)."""
        user = decision.candidate.user or str(decision.candidate.uid)
        for entry in reversed(self._stops):
            if entry[1] == user:
                self._stops.remove(entry)  # the caps count stops, not attempts
                break
        # Judged afresh at the next check: warned again (in full) if contended again.
        self._acted.discard(_key(decision))
        if warning is not None and warning.issued:
            self._withdrawn(decision, hostname, "uncontended", "its GPU is no longer contended")

    def join(self, timeout: float | None = None) -> None:
        """Wait for a stop in progress (tests, shutdown)."""
        if self._worker is not None:
            self._worker.join(timeout)


def _lost(warning: PendingWarning) -> bool:
    """True when ``warning`` will never reach the server: refused for good, or dropped."""
    delivery = warning.delivery
    lost = delivery is not None and not delivery.pending and not delivery.delivered
    if lost:
        log.warning(
            "reaper: the warning for %s did not reach the server; warning again",
            describe(warning.decision),
        )
    return lost


def _unreadable(snapshot: HostSnapshot, warned: Decision, current: Decision | None) -> list[int]:
    """The GPUs the warned process held memory on that this snapshot cannot read (lost,
    a read error, not listed), as the warning saw them or as the plan now does."""
    now = (
        []
        if current is None
        else [h.gpu_index for h in current.candidate.holdings if not h.readable]
    )
    return sorted(set(unreadable_gpus(snapshot, warned.candidate.holdings)) | set(now))


def _key(decision: Decision) -> Key:
    return decision.candidate.pid, decision.candidate.start_time


def _ratio(used: int | None, total: int | None) -> float | None:
    """How full memory is (``None``: unknown)."""
    if not total or used is None:
        return None
    return used / total


def _instance(gpu: Gpu, gpu_instance_id: int | None) -> MigInstance | None:
    """The MIG instance of ``gpu`` with NVML's GPU instance id ``gpu_instance_id``."""
    if gpu_instance_id is None:
        return None
    return next((m for m in gpu.mig_instances if m.gpu_instance_id == gpu_instance_id), None)


def _places(gpu: Gpu) -> list[Place]:
    """Where an OOM on ``gpu`` can count: the GPU off MIG, else each MIG instance."""
    if not gpu.mig_instances:
        return [(gpu.index, None)]
    return [
        (gpu.index, m.gpu_instance_id) for m in gpu.mig_instances if m.gpu_instance_id is not None
    ]


class NextPoll:
    """The executor's observer inside the agent: waits for the next poll's snapshot.

    The agent's poll loop calls :meth:`offer` with each snapshot; :meth:`observe`
    returns the first one offered after it was called, or ``None`` after
    ``timeout_seconds`` (NVML is read only by the poll loop, never concurrently).
    """

    def __init__(self, timeout_seconds: float) -> None:
        self._timeout = timeout_seconds
        self._cond = threading.Condition()
        self._latest: HostSnapshot | None = None
        self._count = 0

    def offer(self, snapshot: HostSnapshot) -> None:
        with self._cond:
            self._latest = snapshot
            self._count += 1
            self._cond.notify_all()

    def observe(self) -> HostSnapshot | None:
        with self._cond:
            seen = self._count
            if not self._cond.wait_for(lambda: self._count > seen, timeout=self._timeout):
                return None
            return self._latest
