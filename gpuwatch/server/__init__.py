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
    events/         orphaned / runaway / idle / gpu_lost / agent_silent / reaped / oom
    ingest/         POST /api/v1/snapshots: idempotency, state upserts, detector calls
    fleet/          the fleet summary
    detectors/      pure detector functions (no DB, no clock)
    metrics.py      /metrics, built from the database at scrape time
    jobs.py         retention, agent_silent, stale lifetimes; scheduler.py runs them
    client.py       the HTTP client `gpuwatch history` uses

Nothing here is created at import: this module imports nothing, so the pure
detectors can be imported without FastAPI or SQLAlchemy.
"""
