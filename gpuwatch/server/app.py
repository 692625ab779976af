"""The FastAPI app factory. Nothing is created at import: call :func:`create_app`."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import APIRouter, Depends, FastAPI, Request, Response, status
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sqlalchemy import Engine, text
from sqlalchemy.exc import SQLAlchemyError
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match
from starlette.types import ASGIApp, Receive, Scope, Send

from gpuwatch import __version__
from gpuwatch.errors import DatabaseError
from gpuwatch.host_origin import RequestGuard
from gpuwatch.server.alerts.engine import AlertEngine
from gpuwatch.server.alerts.views import router as alerts_router
from gpuwatch.server.database.core import Database, database_for, describe, is_unavailable
from gpuwatch.server.deps import Context, ServerContext, require_reader
from gpuwatch.server.events.views import router as events_router
from gpuwatch.server.fleet.views import router as fleet_router
from gpuwatch.server.hosts.views import router as hosts_router
from gpuwatch.server.ingest.cache import HostStateCache
from gpuwatch.server.ingest.views import openapi_schemas as ingest_openapi_schemas
from gpuwatch.server.ingest.views import router as ingest_router
from gpuwatch.server.ingest.writer import IngestWriter
from gpuwatch.server.metrics import IngestStatusMiddleware, ServerStats, build_registry
from gpuwatch.server.notifications.receivers.base import build_receiver
from gpuwatch.server.pagination import InvalidCursor
from gpuwatch.server.processes.views import router as processes_router
from gpuwatch.server.scheduler import start_scheduler
from gpuwatch.server.web import install as install_web
from gpuwatch.settings import ServerSettings, parse_host_port

log = logging.getLogger(__name__)

# What a 503 tells the agent: try again in this many seconds (it backs off further).
RETRY_AFTER_SECONDS = 5
# A 422 lists at most this many problems; one is usually enough to fix the client.
MAX_REPORTED_ERRORS = 20


def create_app(
    settings: ServerSettings,
    *,
    clock: Callable[[], float] = time.time,
    engine: Engine | None = None,
    http_transport: httpx.BaseTransport | None = None,
    monotonic: Callable[[], float] = time.monotonic,
) -> FastAPI:
    """Build the API for ``settings``.

    ``clock`` (epoch seconds) is the server's notion of now, and ``monotonic`` the
    clock that request time budgets run on; both injected for tests.
    ``engine`` replaces the one built from ``settings.resolved_database_url()``; the
    app disposes only an engine it built. ``http_transport`` replaces the network
    under the receivers' HTTP client. The schema must already be migrated
    (``gpuwatch server`` does that before serving). The scheduler starts with the app
    when ``settings.scheduler`` is true.
    """
    owned = engine is None
    database = database_for(settings) if engine is None else Database.from_engine(engine)
    stats = ServerStats()
    # One client for every receiver: its connection pool is shared, and it is closed
    # with the app. Timeouts are per receiver (set on each request).
    http = httpx.Client(transport=http_transport, follow_redirects=False)
    alerts = AlertEngine(
        receivers={
            config.name: build_receiver(config, client=http, clock=clock)
            for config in settings.receivers
        },
        clock=clock,
        on_outcome=lambda receiver, outcome: stats.count(stats.notifications, (receiver, outcome)),
    )
    stats.expect_receivers(alerts.receivers)
    context = ServerContext(
        settings=settings,
        database=database,
        clock=clock,
        stats=stats,
        host_states=HostStateCache(settings.state_cache_hosts),
        alerts=alerts,
        monotonic=monotonic,
    )

    writer = IngestWriter(context)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        scheduler = None
        if settings.scheduler:
            scheduler = start_scheduler(
                database=database, settings=settings, clock=clock, stats=stats, engine=alerts
            )
        try:
            yield
        finally:
            # Before the database goes: what it has queued is stored and answered.
            await asyncio.to_thread(writer.close)
            if scheduler is not None:
                scheduler.shutdown(wait=True)
            http.close()
            if owned:
                database.dispose()

    app = FastAPI(
        title="gpuwatch server",
        version=__version__,
        summary="Fleet history of GPU memory holders: who held what, when, and what was wrong.",
        lifespan=lifespan,
        # Starlette's limiter: refuses on Content-Length before reading, and counts
        # streamed (chunked) bytes as they arrive, so an oversized body is never
        # buffered whole. Both give 413.
        max_body_size=settings.max_body_bytes,
        # FastAPI's docs pages load their assets from a CDN; web/docs.py serves /docs
        # from this server instead (and ReDoc, which cannot be offline, not at all).
        docs_url=None,
        redoc_url=None,
    )
    app.state.gpuwatch = context
    app.state.ingest_writer = writer
    app.add_middleware(IngestStatusMiddleware, stats=stats)
    # Outermost: a request under a foreign Host (DNS rebinding) or a cross-site change
    # is answered before anything else runs, its body unread.
    app.add_middleware(
        RequestGuardMiddleware,
        guard=RequestGuard.for_listener(
            parse_host_port(settings.listen)[0],
            settings.allowed_hosts,
            setting="[server] allowed_hosts",
        ),
    )
    _add_error_handlers(app)
    for router in (
        ingest_router,
        events_router,
        hosts_router,
        processes_router,
        fleet_router,
        alerts_router,
    ):
        app.include_router(router)
    app.include_router(_operations_router(context))
    install_web(app)  # the dashboard at /, its static files, and /docs
    _document_raw_bodies(app)
    return app


class RequestGuardMiddleware:
    """Refuses, before any route, a request whose ``Host`` this server does not answer
    to (421) or a cross-site change (403): :mod:`gpuwatch.host_origin`."""

    def __init__(self, app: ASGIApp, guard: RequestGuard) -> None:
        self.app = app
        self.guard = guard

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        refused = self.guard.refusal(
            scope["method"],
            headers.get("host"),
            headers.get("origin"),
            headers.get("sec-fetch-site"),
        )
        if refused is None:
            await self.app(scope, receive, send)
            return
        code, reason = refused
        log.warning("%s %s refused %d: %s", scope["method"], scope.get("path", ""), code, reason)
        await JSONResponse({"detail": reason}, status_code=code)(scope, receive, send)


def _document_raw_bodies(app: FastAPI) -> None:
    """Add what FastAPI cannot see to the schema: the bodies views validate themselves
    (see ingest/views.py), the 401 and 403 of routes behind the read or admin token,
    /healthz's 503 and /metrics' text."""
    default_openapi = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = default_openapi()
            schema.setdefault("components", {}).setdefault("schemas", {}).update(
                ingest_openapi_schemas()
            )
            _document_token_answers(schema)
            paths = schema["paths"]
            paths["/healthz"]["get"]["responses"]["503"] = {
                "description": "The database does not answer, or cannot be written; retry later."
            }
            paths["/metrics"]["get"]["responses"]["200"]["content"] = {CONTENT_TYPE_LATEST: {}}
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


_TOKEN_ANSWERS = {
    "401": {"description": "No bearer token, where the server sets one for this route."},
    "403": {"description": "A bearer token that is not the one this route needs."},
}


def _document_token_answers(schema: dict[str, Any]) -> None:
    """401 and 403 on every operation that takes a bearer token (its ``security``)."""
    for operations in schema["paths"].values():
        for operation in operations.values():
            if isinstance(operation, dict) and operation.get("security"):
                for code, answer in _TOKEN_ANSWERS.items():
                    operation["responses"].setdefault(code, answer)


def _operations_router(context: ServerContext) -> APIRouter:
    router = APIRouter(tags=["operations"])
    registry = build_registry(
        database=context.database,
        settings=context.settings,
        stats=context.stats,
        clock=context.clock,
    )

    @router.get("/healthz", summary="Liveness and database reachability")
    def healthz(ctx: Context) -> JSONResponse:
        """200 when the database answers and takes writes, 503 otherwise.

        A database that can be read but not written (a read-only file or mount, a full
        disk) answers reads: after a write failed so, this answers 503 until a write of
        a push's size succeeds (:meth:`Database.write_failure`, tried here).
        """
        try:
            with ctx.database.reader() as session:
                session.execute(text("SELECT 1"))
        except SQLAlchemyError as err:
            log.warning("healthz: database unavailable: %s", describe(err))
            return _unavailable()
        failure = ctx.database.write_failure()
        if failure is not None:
            log.warning("healthz: database cannot be written: %s", failure)
            return _unavailable("database cannot be written, retry later")
        return JSONResponse({"status": "ok", "database": ctx.database.dialect})

    @router.get(
        "/metrics",
        summary="Prometheus metrics (fleet and server)",
        response_class=Response,
        dependencies=[Depends(require_reader)],
    )
    def metrics() -> Response:
        """Prometheus text exposition, built from the database at scrape time."""
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return router


def _unavailable(detail: str = "database unavailable, retry later") -> JSONResponse:
    return JSONResponse(
        {"detail": detail},
        status_code=status.HTTP_503_SERVICE_UNAVAILABLE,
        headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
    )


def _add_error_handlers(app: FastAPI) -> None:
    async def database_error(request: Request, err: Exception) -> JSONResponse:
        if is_unavailable(err):
            log.warning(
                "%s %s: database unavailable: %s", request.method, request.url.path, describe(err)
            )
            return _unavailable()
        # Not an outage: a bug. One log line with the traceback, then a plain 500.
        log.error("%s %s: database error", request.method, request.url.path, exc_info=err)
        return JSONResponse({"detail": "internal error"}, status_code=500)

    async def invalid_request(_request: Request, err: Exception) -> JSONResponse:
        # FastAPI's default echoes each offending input back: a 100 kB string comes
        # back whole, and NaN cannot be encoded at all (a 500). Say where and why only.
        assert isinstance(err, RequestValidationError)
        errors = [
            {"type": e.get("type"), "loc": list(e.get("loc", ())), "msg": e.get("msg")}
            for e in err.errors()[:MAX_REPORTED_ERRORS]
        ]
        return JSONResponse({"detail": errors}, status_code=status.HTTP_422_UNPROCESSABLE_CONTENT)

    async def invalid_cursor(_request: Request, err: Exception) -> JSONResponse:
        # The shape of every other 422 (HTTPValidationError), as the OpenAPI promises.
        error = {"type": "value_error", "loc": ["query", "cursor"], "msg": str(err)}
        return JSONResponse({"detail": [error]}, status_code=status.HTTP_422_UNPROCESSABLE_CONTENT)

    async def http_error(request: Request, err: Exception) -> Response:
        assert isinstance(err, StarletteHTTPException)
        if err.status_code == status.HTTP_405_METHOD_NOT_ALLOWED:
            # Starlette names the methods of the first route on the path only; a path
            # served by two routes (GET and POST /api/v1/events) would under-report.
            err.headers = {**(err.headers or {}), "Allow": _allowed_methods(app, request)}
        return await http_exception_handler(request, err)

    app.add_exception_handler(SQLAlchemyError, database_error)
    app.add_exception_handler(DatabaseError, database_error)
    app.add_exception_handler(InvalidCursor, invalid_cursor)
    app.add_exception_handler(RequestValidationError, invalid_request)
    app.add_exception_handler(StarletteHTTPException, http_error)


_METHODS = ("DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT")


def _allowed_methods(app: FastAPI, request: Request) -> str:
    """Every method some route serves on the request's path (RFC 9110 §15.5.6), asked
    of the routes themselves: included routers do not list their routes' methods."""
    allowed = []
    for method in _METHODS:
        scope = {
            "type": "http",
            "method": method,
            "path": request.scope["path"],
            "root_path": request.scope.get("root_path", ""),
            "headers": [],
            "query_string": b"",
        }
        if any(route.matches(scope)[0] == Match.FULL for route in app.router.routes):
            allowed.append(method)
    return ", ".join(allowed)
