"""The dashboard's pages over HTTP: thin views that read through the services and hand
the results to the templates.

``/`` fleet, ``/hosts/{hostname}`` and ``/hosts/{hostname}/gpus/{index}`` detail
(or ``/hosts/?name=...&gpu=...``),
``/events`` timeline, ``/alerts``; ``/login`` and ``/logout`` for the read token
(see auth.py). Pages are ``no-store`` (they show live data) and carry a
Content-Security-Policy that allows this server's own scripts and styles only, so a
hostname or command an agent sent cannot run as script even if escaping failed.
"""

from __future__ import annotations

from collections.abc import Sequence

from fastapi import APIRouter, Depends, Path, Query, Request, status
from starlette.responses import HTMLResponse, RedirectResponse, Response

from gpuwatch.server.alerts import service as alert_service
from gpuwatch.server.deps import Context, ReadSession, ServerContext
from gpuwatch.server.events import service as event_service
from gpuwatch.server.events.models import EVENT_KINDS
from gpuwatch.server.events.schemas import EventOut
from gpuwatch.server.hosts import service as host_service
from gpuwatch.server.hosts.views import spelled_segments
from gpuwatch.server.pagination import Cursor, InvalidCursor
from gpuwatch.server.web import auth, service, tiles
from gpuwatch.server.web.templates.alerts import alerts_page
from gpuwatch.server.web.templates.detail import gpu_page, host_page
from gpuwatch.server.web.templates.events import EventFilters, events_page, format_utc, parse_utc
from gpuwatch.server.web.templates.fleet import fleet_page
from gpuwatch.server.web.templates.layout import DEFAULT_RANGE, RANGES, Chrome, not_found
from gpuwatch.server.web.templates.login import login_page
from gpuwatch.snapshot import NO_NUL

HEADERS = {
    "Cache-Control": "no-store",
    "Content-Security-Policy": (
        "default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; "
        "object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
}
EVENTS_PER_PAGE = 200
# Events marked on a host's or a GPU's charts at most (newest first).
CHART_EVENTS = 500
HOST_CHART_COLUMNS = 180
# The longest hostname or user an agent can send (gpuwatch.snapshot.ShortStr), and the
# GPU indexes the pages take (as the API's).
MAX_TEXT = 256
MAX_GPU_INDEX = 1024
GPU_CHART_COLUMNS = 360
# The longest span the events page's chart takes without a time filter (the longest
# range of the detail pages).
CHART_MAX_DAYS = 30

pages = APIRouter(include_in_schema=False, dependencies=[Depends(auth.require_page_reader)])
public = APIRouter(include_in_schema=False)


def html(body: str, status_code: int = 200) -> HTMLResponse:
    return HTMLResponse(body, status_code=status_code, headers=HEADERS)


def _chrome(request: Request, session: ReadSession, context: ServerContext, now: float) -> Chrome:
    return Chrome(
        root=request.scope.get("root_path", ""),
        now=now,
        firing=service.firing_alerts(session=session),
        sign_out=auth.token_required(context) and auth.COOKIE in request.cookies,
    )


def _range(value: str | None) -> tuple[str, float]:
    """A detail page's range: an unknown value (whatever it holds) is the default."""
    key = value if value in RANGES else DEFAULT_RANGE
    return key, RANGES[key][0]


def _bad_name(value: str) -> bool:
    """A hostname no agent can have sent (past 256 characters): not found, unread."""
    return len(value) > MAX_TEXT


def _gpu_index(value: str) -> int | None:
    """A GPU index from a URL: an ASCII whole number below 1024, else None."""
    if not (value.isascii() and value.isdigit()) or len(value) > 4:
        return None
    index = int(value)
    return index if index < MAX_GPU_INDEX else None


def _text_filter(name: str, value: str, errors: list[str]) -> str:
    """A free-text filter of the events page; one longer than anything an agent can
    send is ignored and reported."""
    value = value.strip()
    if len(value) > MAX_TEXT:
        errors.append(f"Ignored a filter: the {name} is longer than {MAX_TEXT} characters.")
        return ""
    return value


@pages.get("/", response_class=HTMLResponse)
def fleet(request: Request, session: ReadSession, context: Context) -> HTMLResponse:
    now = context.clock()
    data = tiles.fleet_tiles(session=session, settings=context.settings, now=now)
    return html(fleet_page(_chrome(request, session, context, now), data))


# Host and GPU pages: /hosts/NAME and /hosts/NAME/gpus/N, with NAME percent-encoded
# as one segment and read from the raw path (a name may hold "/", even end in
# "/gpus/1"), or /hosts/?name=NAME[&gpu=N], which carries any name, "." and ".."
# included (browsers drop such path segments before sending). format.host_path
# writes the links.
@pages.get("/hosts/{address:path}", response_class=HTMLResponse)
def host_or_gpu(
    request: Request,
    session: ReadSession,
    context: Context,
    address: str = Path(pattern=NO_NUL),
    name: str | None = Query(None, pattern=NO_NUL),
    gpu: str | None = Query(None, pattern=NO_NUL),
    range: str | None = Query(None, pattern=NO_NUL),
) -> HTMLResponse:
    now = context.clock()
    chrome = _chrome(request, session, context, now)
    target = _address(request, address, name, gpu)
    if target is None:
        return html(not_found(chrome, "No host or GPU has this address."), 404)
    hostname, index = target
    if index is None:
        return _host(session, context, chrome, hostname, range)
    return _gpu(session, context, chrome, hostname, index, range)


def _address(
    request: Request, address: str, name: str | None, gpu: str | None
) -> tuple[str, str | None] | None:
    """(hostname, GPU index as written or None for the host page) that a /hosts/ URL
    names, or None when it names neither."""
    if name is not None:
        return (name, gpu) if address == "" else None
    segments = spelled_segments(request, address)
    if len(segments) == 1:
        return segments[0], None
    if len(segments) == 3 and segments[1] == "gpus":
        return segments[0], segments[2]
    return None


def _gpu(
    session: ReadSession,
    context: ServerContext,
    chrome: Chrome,
    hostname: str,
    index: str,
    range: str | None,
) -> HTMLResponse:
    now = chrome.now
    gpu_index = _gpu_index(index)
    detail = (
        None
        if _bad_name(hostname) or gpu_index is None
        else host_service.get_host(
            session=session,
            hostname=hostname,
            settings=context.settings,
            now=now,
            gpu_index=gpu_index,
        )
    )
    found = None if detail is None else next((g for g in detail.gpus if g.index == gpu_index), None)
    refs = (
        []
        if found is None
        else [
            ref
            for ref in service.host_gpus(session=session, hostname=hostname)
            if ref.gpu_index == gpu_index
        ]
    )
    if detail is None or found is None or not refs:
        return html(not_found(chrome, f"No GPU {index!r} on a host named {hostname!r}."), 404)
    key, seconds = _range(range)
    ref = next((r for r in refs if r.uuid == found.uuid), refs[0])
    history = service.histories(
        session=session,
        gpus=[ref],
        until=now,
        seconds=seconds,
        interval=context.settings.sample_interval_seconds,
        columns=GPU_CHART_COLUMNS,
    )[ref.id]
    events = event_service.list_events(
        session=session, hostname=hostname, since=now - seconds, until=now, limit=CHART_EVENTS
    ).items
    return html(gpu_page(chrome, detail, found, history, events, range_key=key))


def _host(
    session: ReadSession,
    context: ServerContext,
    chrome: Chrome,
    hostname: str,
    range: str | None,
) -> HTMLResponse:
    now = chrome.now
    detail = (
        None
        if _bad_name(hostname)
        else host_service.get_host(
            session=session, hostname=hostname, settings=context.settings, now=now
        )
    )
    if detail is None:
        return html(not_found(chrome, f"No host named {hostname!r}."), 404)
    key, seconds = _range(range)
    gpus = service.host_gpus(session=session, hostname=hostname)
    histories = service.histories(
        session=session,
        gpus=gpus,
        until=now,
        seconds=seconds,
        interval=context.settings.sample_interval_seconds,
        columns=HOST_CHART_COLUMNS,
    )
    events = event_service.list_events(
        session=session, hostname=hostname, since=now - seconds, until=now, limit=CHART_EVENTS
    ).items
    charts = {gpu.uuid: histories[gpu.id] for gpu in gpus}
    return html(host_page(chrome, detail, charts, events, range_key=key))


@pages.get("/events", response_class=HTMLResponse)
def events(
    request: Request,
    session: ReadSession,
    context: Context,
    host: str = Query("", pattern=NO_NUL),
    gpu: str = Query("", pattern=NO_NUL),
    user: str = Query("", pattern=NO_NUL),
    kind: str = Query("", pattern=NO_NUL),
    state: str = Query("", pattern=NO_NUL),
    since: str = Query("", pattern=NO_NUL),
    until: str = Query("", pattern=NO_NUL),
    cursor: str | None = Query(None, pattern=NO_NUL),
) -> HTMLResponse:
    """Every filter is optional and arrives as the form sent it (empty when unset). A
    filter that does not parse, or could not match (past 256 characters), is ignored
    and reported on the page, the rest still apply; only a NUL, which no filter can
    hold (Postgres refuses it), is a 422, as on every page and API parameter."""
    now = context.clock()
    errors: list[str] = []
    host = _text_filter("host", host, errors)
    user = _text_filter("user", user, errors)
    gpu = gpu.strip()
    gpu_index = None
    if gpu:
        gpu_index = _gpu_index(gpu)
        if gpu_index is None:
            errors.append(f"Ignored a filter: GPU {gpu[:16]!r} is not a GPU index (0 to 1023).")
            gpu = ""
    if kind and kind not in EVENT_KINDS:
        errors.append(f"Ignored a filter: unknown kind {kind[:32]!r}.")
        kind = ""
    if state not in ("", "open", "ended"):
        errors.append(f"Ignored a filter: state {state[:16]!r} (open or ended).")
        state = ""
    times: list[float | None] = []
    for name, value in (("from", since), ("to", until)):
        try:
            if len(value) > 64:
                raise ValueError(f"not a time: {value[:16]!r}… (use YYYY-MM-DDTHH:MM, UTC)")
            times.append(parse_utc(value))
        except ValueError as err:
            errors.append(f"Ignored a filter: {err} ({name}).")
            times.append(None)
    start, end = times
    if start is not None and end is not None and start > end:
        errors.append("Ignored a filter: the time range ends before it starts.")
        start = end = None
    since = since if start is not None else ""
    until = until if end is not None else ""
    page_cursor = None
    if cursor is not None:
        try:
            if len(cursor) > 200:
                raise InvalidCursor("invalid cursor")
            page_cursor = Cursor.decode(cursor, of=event_service.EVENTS)
        except (ValueError, InvalidCursor):
            errors.append("Ignored a filter: invalid cursor (a page link this page did not make).")
    filters = EventFilters(host, gpu, user, kind, state, since, until)
    error = " ".join(errors) or None
    found = event_service.list_events(
        session=session,
        hostname=filters.host or None,
        gpu_index=gpu_index,
        user=filters.user or None,
        kind=kind or None,
        since=start,
        until=end,
        is_open={"open": True, "ended": False}.get(state),
        limit=EVENTS_PER_PAGE,
        cursor=page_cursor,
    )
    chart_until = end if end is not None else now
    chart_since = start if start is not None else _chart_start(found.items, chart_until)
    if chart_since >= chart_until:
        chart_since = chart_until - 3600
    if since and start is not None:
        filters = filters._replace(since=format_utc(start))
    if until and end is not None:
        filters = filters._replace(until=format_utc(end))
    return html(
        events_page(
            _chrome(request, session, context, now),
            filters,
            found.items,
            since=chart_since,
            until=chart_until,
            next_cursor=found.next_cursor,
            error=error,
        )
    )


def _chart_start(events: Sequence[EventOut], until: float) -> float:
    """Where the events page's chart starts when no time filter is set: at the oldest
    of the events shown, unless the oldest tenth of them stretch it more than tenfold
    (one event dated years back would squeeze the rest into a pixel): then after them;
    and no more than 30 days before ``until``. Events left out are still listed."""
    starts = sorted(ev.started_at for ev in events)
    if not starts:
        return until - 86400
    start, trimmed = starts[0], starts[len(starts) // 10]
    if (until - trimmed) * 10 < until - start:
        start = trimmed
    return max(start, until - CHART_MAX_DAYS * 86400)


@pages.get("/alerts", response_class=HTMLResponse)
def alerts(request: Request, session: ReadSession, context: Context) -> HTMLResponse:
    now = context.clock()
    receivers = {} if context.alerts is None else context.alerts.receivers
    return html(
        alerts_page(
            _chrome(request, session, context, now),
            alert_service.list_alerts(session=session, states=("firing", "pending"), now=now),
            alert_service.list_silences(session=session, now=now, include_expired=False),
            alert_service.receiver_states(session=session, receivers=receivers),
        )
    )


@public.get("/login", response_class=HTMLResponse)
def login_form(
    request: Request, context: Context, next: str = Query("/", max_length=2048, pattern=NO_NUL)
) -> Response:
    root = request.scope.get("root_path", "")
    if not auth.token_required(context):
        return RedirectResponse(f"{root}/", status_code=status.HTTP_303_SEE_OTHER)
    if auth.signed_in(request, context):  # already signed in: on to the page asked for
        return RedirectResponse(auth.safe_next(next), status_code=status.HTTP_303_SEE_OTHER)
    return html(login_page(root, next_path=auth.safe_next(next), message=None))


@public.post("/login", response_class=HTMLResponse)
async def login(request: Request, context: Context) -> Response:
    token, next_path = await auth.read_login_form(request)
    if auth.token_accepted(request, context, token):
        return auth.sign_in(request, token, next_path)
    root = request.scope.get("root_path", "")
    return html(
        login_page(
            root, next_path=auth.safe_next(next_path), message="That token was not accepted."
        ),
        status.HTTP_401_UNAUTHORIZED,
    )


@public.post("/logout")
async def logout(request: Request) -> Response:
    return auth.sign_out(request.scope.get("root_path", ""))


def login_required(request: Request, err: Exception) -> Response:
    """The answer to :class:`auth.LoginRequired`: 401 with the login form."""
    assert isinstance(err, auth.LoginRequired)
    if err.reload:
        return auth.reload_page()
    message = "Your session has ended; sign in again." if err.rejected else None
    response = html(
        login_page(request.scope.get("root_path", ""), next_path=err.next_path, message=message),
        status.HTTP_401_UNAUTHORIZED,
    )
    response.headers["WWW-Authenticate"] = "Bearer"
    return response
