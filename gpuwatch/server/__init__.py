"""The central gpuwatch service: ingest of agent snapshots, history, events, read API.

Layout (one package per domain, each with ``models`` / ``schemas`` / ``service`` /
``views`` as it needs them; routers translate HTTP, services hold the logic and take
the session as a keyword argument)::

    app.py          create_app(settings, *, clock, engine): the FastAPI factory
    deps.py         request dependencies: sessions, clock, settings, read auth
    database/       engine factory (SQLite pragmas, BEGIN IMMEDIATE), Base, migrations runner
    migrations/     Alembic env and versions, run programmatically
    auth/           per-host agent tokens (only their SHA-256 is stored)
    hosts/          hosts and GPUs, their last state and per-GPU coarse samples
    processes/      process lifetimes and per-process coarse samples; history queries
    events/         orphaned / runaway / idle / filling_up / gpu_lost / agent_silent / reaped /
                    oom; the one path that writes events, with their outbox
    ingest/         POST /api/v1/snapshots: idempotency, state upserts, detector calls
    fleet/          the fleet summary
    alerts/         the alert engine: rules, life cycle, grouping, silences, notification log
    notifications/  receivers (Slack, signed webhook, Alertmanager) and what they are sent
    metrics.py      /metrics, built from the database at scrape time
    jobs.py         retention, agent_silent, stale lifetimes; scheduler.py runs them (and alerts)
    client.py       the HTTP client `gpuwatch history` uses

The pure detectors live in ``gpuwatch/detectors/``. Nothing here is created at import:
this module imports nothing.
"""
