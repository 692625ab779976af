"""``gpuwatch reap``: free GPU memory held by idle processes, safely (docs/reaper.md).

    gpuwatch reap --idle 2h --dry-run      # who would be stopped, and why
    gpuwatch reap --idle 2h                # asks before stopping them
    gpuwatch reap --pid 4242               # the one `gpuwatch explain` pointed at

Idle evidence comes from the local agent's history (``--agent``), and, for a process
the agent has watched for less than the window (it restarted), from the central
server's samples before that, when ``[agent] server_url`` is set. This command polls
NVML itself only to see who is on the GPUs now and to confirm, right before each
signal, that a process is still idle. Without history nothing is idle.

Right before each signal the agent's history is read again and the process judged
again as of that moment (:func:`gpuwatch.agent.reaper.plan.rejudge`): a process that
ran anything while the prompt waited, or during an earlier process's grace period, is
not signalled.

Exit codes: 0 every chosen process stopped (or a dry run chose some); 20 nothing to
do; 21 partial (some chosen processes were not stopped); 22 refused before any signal
(not safe here, not confirmed, no answer at the prompt, audit log unwritable, ``--pid``
target not eligible, the history served by something other than the agent); 130
interrupted (Ctrl-C, or SIGTERM) while stopping: the stop in progress is recorded as
``interrupted``; plus the usual 2 (usage), 3 (bad setting, ``--idle`` below its floor),
4 (no NVML).
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from gpuwatch.cli.agent import CONFIG_HELP, use_config_file

if TYPE_CHECKING:
    from rich.console import Console

    from gpuwatch.agent.reaper.central import ServerLookup
    from gpuwatch.agent.reaper.events import EventPoster
    from gpuwatch.agent.reaper.execute import Executor, Rejudge
    from gpuwatch.agent.reaper.history import Run
    from gpuwatch.agent.reaper.plan import IdleRule, Plan
    from gpuwatch.agent.reaper.policy import Decision
    from gpuwatch.agent.reaper.served import HistoryReport
    from gpuwatch.agent.reaper.settings import ReapSettings
    from gpuwatch.agent.sampler import Sampler
    from gpuwatch.server.client import HistoryClient
    from gpuwatch.settings import AgentSettings
    from gpuwatch.snapshot import HostSnapshot


def register(app: typer.Typer) -> None:
    app.command()(reap)


def reap(
    idle: str | None = typer.Option(
        None, "--idle", metavar="DURATION", help="Stop processes idle this long (90s, 30m, 2h, 1d)."
    ),
    pid: int | None = typer.Option(
        None, "--pid", metavar="PID", min=2, help="Only this process (it must be idle too)."
    ),
    dry_run: bool = typer.Option(
        False, "--dry-run", help="Print what would be done; send nothing."
    ),
    yes: bool = typer.Option(False, "--yes", "-y", help="Do not ask for confirmation (scripts)."),
    grace: str | None = typer.Option(
        None,
        "--grace",
        metavar="DURATION",
        help="SIGTERM, wait this long, then SIGKILL (default 30s).",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
    agent: str | None = typer.Option(
        None,
        "--agent",
        metavar="URL",
        help="Local agent whose history to use (default: its listen address).",
    ),
    fake_gpus: str | None = typer.Option(
        None,
        "--fake-gpus",
        metavar="SCENARIO",
        help="Simulate GPUs from a scenario file or bundled name.",
    ),
    users: list[str] = typer.Option(
        [], "--user", metavar="USER", help="Only these users' processes."
    ),
    gpus: list[int] = typer.Option(
        [], "--gpu", metavar="INDEX", help="Only processes on these GPUs."
    ),
    min_memory: str | None = typer.Option(
        None, "--min-memory", metavar="SIZE", help="Memory floor on some GPU (default 256MiB)."
    ),
    match: str | None = typer.Option(
        None, "--match", metavar="REGEX", help="Only commands matching."
    ),
    exclude: str | None = typer.Option(
        None, "--exclude", metavar="REGEX", help="Skip commands matching."
    ),
    only_orphans: bool = typer.Option(False, "--only-orphans", help="Only orphaned processes."),
    force: bool = typer.Option(
        False,
        "--force",
        help="With --pid: stop it even without proof of idleness (protections still apply).",
    ),
    audit_log: Path | None = typer.Option(
        None, "--audit-log", metavar="PATH", help="Audit log file."
    ),
    config: Path | None = typer.Option(None, "--config", help=CONFIG_HELP),
) -> None:
    """Stop processes that hold GPU memory and have been idle for the whole window."""
    from rich.console import Console

    from gpuwatch.agent.reaper.errors import ReapRefused
    from gpuwatch.agent.reaper.report import as_json as to_json
    from gpuwatch.errors import ConfigError
    from gpuwatch.settings import AgentSettings, load

    if idle is None and pid is None:
        raise typer.BadParameter("give --idle DURATION, or --pid PID (optionally with --idle)")
    if force and pid is None:
        raise typer.BadParameter("--force needs --pid: it is for the one process you name")
    _check_users(users)
    use_config_file(config)
    settings = load(AgentSettings, fake_gpus=fake_gpus)
    reap_settings = _reap_settings(
        settings.reap, idle=idle, grace=grace, min_memory=min_memory, audit_log=audit_log
    )
    try:
        match_re = re.compile(match) if match else None
        exclude_re = re.compile(exclude) if exclude else None
    except re.error as err:
        raise ConfigError(f"--match / --exclude: bad regex: {err}") from None
    console = Console(stderr=as_json, highlight=False)
    if not console.is_terminal:
        console.width = 160  # a log or a pipe: room for commands and reasons
    session = _Session(
        settings, reap_settings, console=console, agent_url=agent, force=force, dry_run=dry_run
    )
    try:
        plan = session.plan(
            pid=pid,
            users=users,
            gpus=gpus,
            match=match_re,
            exclude=exclude_re,
            only_orphans=only_orphans,
        )
    except ReapRefused as err:
        session.refuse(str(err), dry_run=dry_run)
        if as_json:
            typer.echo(to_json(None, [], dry_run=dry_run, refused=str(err)))
        raise
    code = session.execute(plan, dry_run=dry_run, yes=yes, as_json=as_json, pid=pid)
    raise typer.Exit(code)


def _reap_settings(
    base: ReapSettings,
    *,
    idle: str | None,
    grace: str | None,
    min_memory: str | None,
    audit_log: Path | None,
) -> ReapSettings:
    """``[agent.reap]`` with the command line's values on top (validated the same way)."""
    from pydantic import ValidationError

    from gpuwatch.agent.reaper.settings import ReapSettings
    from gpuwatch.errors import ConfigError

    option = {
        "idle_seconds": "--idle",
        "grace_seconds": "--grace",
        "min_memory_bytes": "--min-memory",
    }
    values = base.model_dump()
    for key, value in (
        ("idle_seconds", idle),
        ("grace_seconds", grace),
        ("min_memory_bytes", min_memory),
    ):
        if value is not None:
            values[key] = value
    if audit_log is not None:
        values["audit_log"] = audit_log
    try:
        return ReapSettings.model_validate(values)
    except ValidationError as err:
        first = err.errors()[0]
        where = option.get(str(first["loc"][0]), str(first["loc"][0]))
        raise ConfigError(f"{where}: {str(first['msg']).removeprefix('Value error, ')}") from None


class _Session:
    """One invocation: the live NVML view, the agent's history, the plan and its execution."""

    def __init__(
        self,
        settings: AgentSettings,
        reap: ReapSettings,
        *,
        console: Console,
        agent_url: str | None,
        force: bool,
        dry_run: bool,
    ) -> None:
        import secrets
        import time

        from gpuwatch.agent.assemble import build_sampler
        from gpuwatch.agent.reaper.policy import Protections
        from gpuwatch.agent.reaper.procfs import may_signal_anyone
        from gpuwatch.agent.state import AgentState

        self.settings = settings
        self.reap = reap
        self.console = console
        self.force = force
        self.dry_run = dry_run
        from gpuwatch.agent.procinfo import read_boot_time

        self.agent_url = agent_url or _agent_url(settings.listen)
        self.now = time.time  # until the history says which clock its times are on
        self.sampler = build_sampler(settings, AgentState())
        # The btime this command's start times come from (the sampler read it just now).
        self.boot_time = read_boot_time(settings.proc_root)
        self.history: HistoryReport | None = None
        self.rule: IdleRule | None = None
        self.server_answers: _Remembered | None = None
        # Every poll of this run, the plan's and the confirming ones, goes through it.
        self.observer = _SamplerObserver(self.sampler)
        self.caller_uid = None if may_signal_anyone(settings.proc_root) else os.geteuid()
        self.run_id = secrets.token_hex(6)
        self.protections = Protections.from_settings(
            reap, self_pids=(os.getpid(), os.getppid()), proc_root=settings.proc_root
        )
        self.notes: list[str] = []
        self.poster: EventPoster | None = None
        self._executor: Executor | None = None
        self.hostname = "?"

    def plan(
        self,
        *,
        pid: int | None,
        users: list[str],
        gpus: list[int],
        match: re.Pattern[str] | None,
        exclude: re.Pattern[str] | None,
        only_orphans: bool,
    ) -> Plan:
        import contextlib
        import time
        from functools import partial

        from gpuwatch.agent.reaper.central import ServerHistory, on_clock
        from gpuwatch.agent.reaper.clock import boottime
        from gpuwatch.agent.reaper.plan import CURRENT_POLLS, IdleRule, make_plan
        from gpuwatch.agent.reaper.policy import Selection
        from gpuwatch.agent.reaper.procfs import job_key

        snapshot = self.observer.poll()
        self.hostname = snapshot.hostname
        problem = self.executor.signal_problem()
        if problem is not None:
            if not self.dry_run:
                from gpuwatch.agent.reaper.errors import ReapRefused

                raise ReapRefused(problem)
            self.notes.append(f"a real run would be refused: {problem}")
        missing = sorted(set(gpus) - {gpu.index for gpu in snapshot.gpus})
        if missing:
            # A typo would otherwise answer "nothing to reap", as if the GPU were clean.
            from gpuwatch.errors import ConfigError

            known = ", ".join(str(gpu.index) for gpu in snapshot.gpus) or "none"
            raise ConfigError(f"--gpu {missing[0]}: no such GPU on this host (GPUs: {known})")
        history = self._history(snapshot.hostname, snapshot.boot_id, pid)
        self.history = history
        r = self.reap
        runs_for = held_on = None
        # Against the interval the agent reports; with no agent, against this host's
        # configured one, so a window no history could judge is refused either way
        # (before, --idle 1s with no agent answering was "nothing to do").
        interval = (
            self.settings.poll_interval_seconds
            if history is None
            else history.poll_interval_seconds
        )
        _check_idle_floor(r.idle_seconds, interval)
        if history is not None:
            self.now = lambda: history.now_on_its_clock(time.time, boottime)
            runs_for, held_on = history.lookups(self.boot_time)
        selection = Selection(
            window_seconds=r.idle_seconds,
            min_memory_bytes=r.min_memory_bytes,
            users=frozenset(users),
            gpus=frozenset(gpus),
            match=match,
            exclude=exclude,
            only_orphans=only_orphans,
            pid=pid,
            force=self.force,
        )
        # The server's samples only extend an agent history of this host and boot.
        client = self._server_client() if history is not None else None
        server = None
        if client is not None:
            server = ServerHistory(
                client,
                hostname=snapshot.hostname,
                server_url=str(self.settings.server_url),
                note=self.notes.append,
            )
        self.rule = IdleRule(
            r.idle_seconds,
            r.min_memory_bytes,
            r.max_gap_seconds,
            r.coverage_ratio,
            # An agent whose polls stopped serves a history that proves nothing now.
            max_age_seconds=None
            if history is None
            else CURRENT_POLLS * history.poll_interval_seconds,
        )
        now = self.now()
        lookup = None
        if server is not None:
            # Kept for the judgement right before each signal: the server's part is the
            # time before the agent's history began, which later polls do not change.
            self.server_answers = _Remembered(on_clock(server, time.time() - now))
            lookup = self.server_answers
        with client if client is not None else contextlib.nullcontext():
            plan = make_plan(
                snapshot,
                runs_for,
                now=now,
                rule=self.rule,
                selection=selection,
                protections=self.protections,
                caller_uid=self.caller_uid,
                notes=self.notes,
                server=lookup,
                held_on=held_on,
                job_of=partial(job_key, proc_root=self.settings.proc_root),
            )
        used = server.summary() if server is not None else None
        if used is not None:
            plan.notes.append(used)
        return plan

    def _server_client(self) -> HistoryClient | None:
        """A reader of the central server this host's agent pushes to (``[agent]
        server_url`` and ``token``), with the read token ``gpuwatch history`` uses
        (``GPUWATCH_SERVER_READ_TOKEN`` or ``[server] read_token``), else the policy's
        (``[agent.reap] server_read_token``): an agent token cannot read. ``None`` when
        no server is configured."""
        import httpx

        from gpuwatch.errors import ConfigError
        from gpuwatch.server.client import HistoryClient
        from gpuwatch.settings import ServerSettings, load

        if not self.settings.server_url or self.settings.token is None:
            return None
        token = None
        try:
            read_token = load(ServerSettings).read_token
        except ConfigError as err:
            self.notes.append(f"no read token for the central server ({err})")
        else:
            token = None if read_token is None else read_token.get_secret_value()
        if token is None and self.reap.server_read_token is not None:
            token = self.reap.server_read_token.get_secret_value()
        try:
            return HistoryClient(self.settings.server_url, token=token, timeout_seconds=5.0)
        except httpx.InvalidURL as err:
            self.notes.append(f"the central server's history is not used (server_url: {err})")
            return None

    def _history(self, hostname: str, boot_id: str, pid: int | None) -> HistoryReport | None:
        """The agent's history, only from a listener on this host owned by root or the
        agent's service user (checked before and after the request, so the socket that
        answered is the one checked); raises ReapRefused otherwise."""
        import dataclasses

        from gpuwatch.agent.reaper.errors import ReapRefused
        from gpuwatch.agent.reaper.served import fetch_history, socket_pids, verify_agent
        from gpuwatch.errors import RemoteError

        proc = self.settings.proc_root
        verify_agent(self.agent_url, proc, caller_uid=self.caller_uid)
        try:
            history = fetch_history(self.agent_url, pid=pid)
        except RemoteError as err:
            self.notes.append(f"{err}: without history no process can be called idle")
            return None
        found = verify_agent(self.agent_url, proc, caller_uid=self.caller_uid)
        if not found:
            raise ReapRefused(
                f"cannot verify who serves the history at {self.agent_url}: nothing listens "
                "there on this host; refusing"
            )
        # The agent itself is never reaped, whatever its command line says.
        agent_pids = socket_pids({f.inode for f in found}, proc)
        self.protections = dataclasses.replace(
            self.protections, self_pids=self.protections.self_pids | agent_pids
        )
        if history.boot_id != boot_id or history.hostname != hostname:
            self.notes.append(
                f"the agent at {self.agent_url} is not on this host and boot; its history is ignored"
            )
            return None
        return history

    @property
    def executor(self) -> Executor:
        if self._executor is None:
            self._executor = _build_executor(self)
        return self._executor

    def rejudge(self, plan: Plan) -> Rejudge:
        """The judgement right before each signal of ``plan``: the agent's history of
        that process fetched again (from a listener checked again) and judged as of
        now. No history then (the agent went away, or serves another host) is no
        proof: the process is spared."""
        import time

        from gpuwatch.agent.reaper.clock import boottime

        def again(decision: Decision, used_now: dict[int, int | None]) -> Decision:
            from gpuwatch.agent.reaper.plan import rejudge
            from gpuwatch.errors import GpuwatchError

            c = decision.candidate
            try:
                history = self._history(plan.hostname, plan.boot_id, c.pid)
            except GpuwatchError as err:
                self.notes.append(f"pid {c.pid}: the agent's history cannot be read again ({err})")
                history = None
            runs_for = None if history is None else history.lookups(self.boot_time)[0]
            now = self.now() if history is None else history.now_on_its_clock(time.time, boottime)
            assert self.rule is not None
            return rejudge(
                decision,
                runs_for,
                now=now,
                planned_at=plan.now,
                rule=self.rule,
                used_now=used_now,
                server=self.server_answers,
            )

        return again

    def refuse(self, reason: str, *, dry_run: bool) -> None:
        """Audit a refusal of the whole run (best effort: the refusal stands anyway)."""
        from gpuwatch.agent.reaper.errors import AuditError
        from gpuwatch.agent.reaper.report import note_line

        try:
            self.executor.refuse(self.hostname, reason, dry_run=dry_run)
        except AuditError as err:
            self.console.print(note_line(str(err)))

    def execute(
        self, plan: Plan, *, dry_run: bool, yes: bool, as_json: bool, pid: int | None
    ) -> int:
        from gpuwatch.agent.reaper.errors import (
            EXIT_NOTHING_TO_DO,
            EXIT_PARTIAL,
            EXIT_REAPED,
            ReapRefused,
        )
        from gpuwatch.agent.reaper.killer import GONE
        from gpuwatch.agent.reaper.report import as_json as to_json
        from gpuwatch.agent.reaper.report import note_line, print_plan, print_results
        from gpuwatch.terminal_text import printable

        executor = self.executor
        if not as_json:
            print_plan(plan, self.console)
        executor.record(plan, dry_run=dry_run)
        if pid is not None and not plan.chosen:
            decision = plan.decisions[0]
            executor.refuse(plan.hostname, decision.detail, dry_run=dry_run, decision=decision)
            if as_json:
                typer.echo(to_json(plan, [], dry_run=dry_run, refused=decision.detail))
            # The audit row and --json above keep the detail as it is; stderr shows it escaped.
            raise ReapRefused(f"not reaping PID {pid}: {printable(decision.detail)}")
        if not plan.chosen:
            if as_json:
                typer.echo(to_json(plan, [], dry_run=dry_run))
            else:
                self.console.print("Nothing to reap.")
            return EXIT_NOTHING_TO_DO
        try:
            if not dry_run and not yes:
                if as_json and sys.stdin.isatty():
                    # The JSON goes to stdout after the run: whoever answers the prompt
                    # reads on the terminal (stderr) what they are asked to stop.
                    print_plan(plan, self.console)
                self._confirm(plan, executor, on_stderr=as_json)
            executor.rejudge = self.rejudge(plan)
            with _sigterm_interrupts():
                results = executor.run(plan, dry_run=dry_run, record=False)
        except ReapRefused as err:
            # Declined, no answer, not a terminal, or no proof whom a pidfd names: the
            # documented object with "refused", as for refusals at the planning stage.
            if as_json:
                typer.echo(to_json(plan, [], dry_run=dry_run, refused=str(err)))
            raise
        notes = self._event_notes()
        if as_json:
            typer.echo(to_json(plan, results, dry_run=dry_run, notes=notes))
        else:
            if dry_run:
                self.console.print(
                    f"Dry run: {len(results)} process(es) would be stopped; nothing sent."
                )
            print_results(results, self.console)
            for note in notes:
                self.console.print(note_line(note))
        if dry_run or all(r.outcome in GONE for r in results):
            return EXIT_REAPED
        return EXIT_PARTIAL

    def _confirm(self, plan: Plan, executor: Executor, *, on_stderr: bool = False) -> None:
        """Ask on the terminal; ``on_stderr`` (``--json``): the question goes to stderr,
        with the table, so that stdout carries the JSON object alone."""
        from gpuwatch.agent.reaper.errors import ReapRefused

        count = len(plan.chosen)
        if not sys.stdin.isatty():
            reason = "not a terminal, so nobody can confirm: pass --yes (or --dry-run)"
            executor.refuse(plan.hostname, reason, dry_run=False)
            raise ReapRefused(reason)
        try:
            with _sigterm_interrupts():
                confirmed = typer.confirm(
                    f"Stop {count} process(es) (SIGTERM, then SIGKILL after "
                    f"{self.reap.grace_seconds:.0f}s)?",
                    err=on_stderr,
                )
        except (typer.Abort, KeyboardInterrupt, EOFError):
            # Ctrl-C, Ctrl-D or SIGTERM at the prompt: nothing was signalled; say so.
            executor.refuse(plan.hostname, "no answer at the prompt (interrupted)", dry_run=False)
            raise ReapRefused("no answer at the prompt; nothing was signalled") from None
        if not confirmed:
            executor.refuse(plan.hostname, "declined at the prompt", dry_run=False)
            raise ReapRefused("declined; nothing was signalled")

    def _event_notes(self) -> list[str]:
        from gpuwatch.agent.reaper.audit import DryRunAudit

        notes = []
        audit = self.executor.audit_log
        if isinstance(audit, DryRunAudit) and audit.error is not None:
            notes.append(f"this dry run is not in the audit log: {audit.error.reason}")
        if self.poster is None:
            notes.append(
                "no server and agent token configured: the reaped events are only in the audit log"
            )
        else:
            notes += [f"the server did not record an event ({f})" for f in self.poster.failures]
        return notes


def _build_executor(session: _Session) -> Executor:
    import pwd

    from gpuwatch.agent.reaper.audit import AuditLog, DryRunAudit
    from gpuwatch.agent.reaper.events import Actor, EventPoster
    from gpuwatch.agent.reaper.execute import Executor
    from gpuwatch.agent.reaper.killer import Killer
    from gpuwatch.agent.reaper.procfs import ProcReader

    uid = os.getuid()
    try:
        user = pwd.getpwuid(uid).pw_name
    except KeyError:
        user = str(uid)
    settings = session.settings
    report = None
    if settings.server_url and settings.token is not None:
        session.poster = EventPoster(settings.server_url, settings.token.get_secret_value())
        report = session.poster.send_event
    r = session.reap
    return Executor(
        killer=Killer(
            ProcReader(settings.proc_root),
            grace_seconds=r.grace_seconds,
            unkillable_seconds=r.unkillable_seconds,
        ),
        audit=(DryRunAudit if session.dry_run else AuditLog)(r.audit_log),
        observer=session.observer,
        protections=session.protections,
        caller_uid=session.caller_uid,
        # The CLI is the one place that reads the environment: SUDO_USER names the
        # person behind sudo, for the audit log.
        actor=Actor(
            uid=uid,
            user=user,
            pid=os.getpid(),
            via="gpuwatch reap",
            sudo_user=os.environ.get("SUDO_USER"),
        ),
        run_id=session.run_id,
        verify_seconds=r.verify_seconds,
        force=session.force,
        report=report,
    )


class _Remembered:
    """A server lookup that asks once per process and GPU and then remembers the answer."""

    def __init__(self, lookup: ServerLookup) -> None:
        self._lookup = lookup
        self._answers: dict[tuple[str, int, float], list[Run] | None] = {}

    def __call__(
        self, *, gpu_index: int, gpu_uuid: str, pid: int, start_time: float, since: float
    ) -> list[Run] | None:
        key = (gpu_uuid, pid, start_time)
        if key not in self._answers:
            self._answers[key] = self._lookup(
                gpu_index=gpu_index, gpu_uuid=gpu_uuid, pid=pid, start_time=start_time, since=since
            )
        return self._answers[key]


class _Terminated(KeyboardInterrupt):
    """SIGTERM while stopping: handled like Ctrl-C (the stop is recorded, exit 130)."""


@contextmanager
def _sigterm_interrupts() -> Iterator[None]:
    """Turn SIGTERM (``kill``, a cron ``timeout``) into an interruption while inside,
    so that a stop in progress is recorded as ``interrupted`` rather than cut off
    without its outcome row. Outside the main thread (tests), nothing changes."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: object) -> None:
        raise _Terminated()

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


class _SamplerObserver:
    """Fresh NVML polls from this process; ``None`` when a poll fails.

    It remembers the busiest activity each process (GPU, PID, start time) showed in any
    poll of this run, the plan's included, and every snapshot it hands out carries at
    least that: activity seen once in this run vetoes a signal, even if a later poll,
    milliseconds after, has no new sample to show it.
    """

    def __init__(self, sampler: Sampler) -> None:
        self._sampler = sampler
        self._busiest: dict[tuple[str, int, float | None], float] = {}

    def poll(self) -> HostSnapshot:
        from gpuwatch.agent.reaper.history import activity_ratio

        snapshot = self._sampler.poll()
        gpus = []
        for gpu in snapshot.gpus:
            processes = []
            for process in gpu.processes:
                key = (gpu.uuid, process.pid, process.start_time)
                ratio = activity_ratio(process, gpu)
                if ratio is not None and ratio > 0:
                    self._busiest[key] = max(self._busiest.get(key, 0.0), ratio)
                seen = self._busiest.get(key)
                if seen is not None and (process.sm_ratio or 0.0) < seen:
                    process = process.model_copy(update={"sm_ratio": seen})
                processes.append(process)
            gpus.append(gpu.model_copy(update={"processes": processes}))
        return snapshot.model_copy(update={"gpus": gpus})

    def observe(self) -> HostSnapshot | None:
        from gpuwatch.errors import GpuwatchError

        try:
            return self.poll()
        except GpuwatchError:
            return None


def _check_users(users: list[str]) -> None:
    """A ``--user`` name that names no account: a typo would otherwise answer "nothing
    to reap", as if that user held nothing (uids are taken as they are)."""
    from gpuwatch.agent.reaper.policy import user_uid
    from gpuwatch.errors import ConfigError

    for user in users:
        if not user.isdigit() and user_uid(user) is None:
            raise ConfigError(f"--user {user}: no such user on this host")


def _check_idle_floor(idle_seconds: float, poll_interval_seconds: float) -> None:
    from gpuwatch.agent.reaper.evidence import format_duration
    from gpuwatch.agent.reaper.settings import MIN_IDLE_POLLS
    from gpuwatch.errors import ConfigError

    floor = MIN_IDLE_POLLS * poll_interval_seconds
    if idle_seconds < floor:
        raise ConfigError(
            f"--idle: {format_duration(idle_seconds)} is too short: at least {MIN_IDLE_POLLS} "
            f"of the agent's poll intervals ({format_duration(floor)})"
        )


def _agent_url(listen: str) -> str:
    host, _, port = listen.rpartition(":")
    host = host.strip("[]")
    if host in ("", "0.0.0.0", "::"):
        host = "127.0.0.1"
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
