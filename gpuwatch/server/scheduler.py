"""Runs :mod:`gpuwatch.server.jobs` on timers inside the server process (APScheduler 3).

Once across replicas: on Postgres each run first takes ``pg_try_advisory_lock`` on a
key named after the job, on a connection it holds for the run; a replica that does not
get it skips that run (counted as ``skipped``). A run due while the job's previous run
is still going is not started (APScheduler's ``max_instances``), counted as ``busy``:
an alert job slower than ``evaluation_interval`` (a Slack backlog) shows there. The lock stops two replicas running a
job at the same time; because every job is idempotent, replicas taking turns is
harmless. On SQLite there is one writer process by design, so jobs simply run.

Every run is guarded: its own sessions (inside the job), any exception logged once
and counted, never propagated into the scheduler thread.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from apscheduler.events import EVENT_JOB_MAX_INSTANCES, JobSubmissionEvent
from apscheduler.schedulers.background import BackgroundScheduler
from sqlalchemy import func, select

from gpuwatch.server import jobs
from gpuwatch.server.alerts.engine import AlertEngine
from gpuwatch.server.database.core import (
    Database,
    advisory_lock_key,
    describe,
    is_unavailable,
)
from gpuwatch.server.metrics import ServerStats
from gpuwatch.settings import ServerSettings

log = logging.getLogger(__name__)

JobFunction = Callable[..., Any]


@dataclass(frozen=True)
class JobSpec:
    name: str
    function: JobFunction
    interval_seconds: float


def job_specs(
    settings: ServerSettings, engine: AlertEngine | None = None, *, up_since: float | None = None
) -> list[JobSpec]:
    """The jobs and how often each runs (``alerts`` when an alert engine is given);
    ``up_since``: when this server started (epoch s), before which no host's silence
    can be judged."""
    every_push = settings.agent_push_interval_seconds
    specs = [
        JobSpec("retention", jobs.purge_expired, 3600.0),
        JobSpec(
            "agent_silent",
            functools.partial(jobs.detect_silent_agents, up_since=up_since),
            every_push,
        ),
        JobSpec(
            "stale_lifetimes",
            functools.partial(jobs.close_stale_lifetimes, up_since=up_since),
            max(60.0, every_push),
        ),
    ]
    if engine is not None:
        specs.append(
            JobSpec(
                "alerts",
                functools.partial(engine.run, up_since=up_since),
                settings.alerts.evaluation_interval_seconds,
            )
        )
    return specs


def run_job(
    spec: JobSpec,
    *,
    database: Database,
    settings: ServerSettings,
    clock: Callable[[], float],
    stats: ServerStats,
) -> str:
    """Run one job once under its lock; return ``ok``, ``failed`` or ``skipped``."""
    started = time.perf_counter()
    try:
        if database.dialect == "postgresql":
            result = _run_locked(spec, database=database, settings=settings, clock=clock)
        else:
            spec.function(database=database, settings=settings, now=clock())
            result = "ok"
    except Exception as err:
        # The guard: one bad run must not kill the scheduler thread. Logged once here,
        # with the traceback only for what is not a plain database outage.
        result = "failed"
        if is_unavailable(err):
            log.warning("job %s failed: database unavailable: %s", spec.name, describe(err))
        else:
            log.exception("job %s failed", spec.name)
    stats.count(stats.job_runs, (spec.name, result))
    log.debug("job %s: %s in %.3f s", spec.name, result, time.perf_counter() - started)
    return result


def _run_locked(
    spec: JobSpec, *, database: Database, settings: ServerSettings, clock: Callable[[], float]
) -> str:
    with database.engine.connect() as lock_connection:
        # Advisory locks belong to the database, not the schema: two installations in
        # two schemas of one database skipped each other's runs (and two test servers
        # did). The default schema keeps the key every earlier version takes, so
        # replicas of two versions still exclude each other during a rolling upgrade.
        schema = lock_connection.scalar(select(func.current_schema()))
        scope = "" if schema in (None, "public") else f"{schema}:"
        key = advisory_lock_key(f"job:{scope}{spec.name}")
        got = lock_connection.scalar(select(func.pg_try_advisory_lock(key)))
        lock_connection.commit()
        if not got:
            return "skipped"
        try:
            spec.function(database=database, settings=settings, now=clock())
        finally:
            try:
                lock_connection.scalar(select(func.pg_advisory_unlock(key)))
                lock_connection.commit()
            except Exception:
                # Closing the session releases its advisory locks; make sure the
                # pool does not hand a connection that still holds one to someone else.
                lock_connection.invalidate()
                raise
    return "ok"


def count_busy(stats: ServerStats) -> Callable[[JobSubmissionEvent], None]:
    """A listener counting the runs APScheduler did not start because the job's previous
    run was still going (it only logs "maximum number of running instances reached")."""

    def listener(event: JobSubmissionEvent) -> None:
        stats.count(stats.job_runs, (event.job_id, "busy"), len(event.scheduled_run_times) or 1)

    return listener


def start_scheduler(
    *,
    database: Database,
    settings: ServerSettings,
    clock: Callable[[], float],
    stats: ServerStats,
    engine: AlertEngine | None = None,
) -> BackgroundScheduler:
    """Start a background scheduler thread running every job on its interval."""
    scheduler = BackgroundScheduler(
        timezone="UTC",
        # A run that is late (server paused, previous run slow) happens once, not
        # once per missed tick, and never overlaps itself.
        job_defaults={"coalesce": True, "max_instances": 1, "misfire_grace_time": 60},
    )
    specs = job_specs(settings, engine, up_since=clock())
    stats.expect_jobs(spec.name for spec in specs)
    scheduler.add_listener(count_busy(stats), EVENT_JOB_MAX_INSTANCES)
    for spec in specs:
        scheduler.add_job(
            run_job,
            "interval",
            seconds=spec.interval_seconds,
            id=spec.name,
            name=spec.name,
            args=[spec],
            kwargs={"database": database, "settings": settings, "clock": clock, "stats": stats},
        )
    scheduler.start()
    log.info("scheduler started: %s", ", ".join(spec.name for spec in specs))
    return scheduler
