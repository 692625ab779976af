"""Alerts, silences and receivers over HTTP: reads need the read token (when set),
changes the admin token (when set; else the read token)."""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any, Literal

from fastapi import APIRouter, HTTPException, Path, Query, Request, Response, status
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from gpuwatch.server.alerts import service
from gpuwatch.server.alerts.schemas import (
    AlertOut,
    ReceiverOut,
    SilenceIn,
    SilenceOut,
    SilenceRefused,
    TestResult,
)
from gpuwatch.server.deps import (
    Admin,
    AdminFirstRoute,
    Context,
    Reader,
    ReadSession,
    WriteSession,
)
from gpuwatch.snapshot import NO_NUL

router = APIRouter(prefix="/api/v1", tags=["alerts"])

TOTAL_HEADER = "X-Total-Count"

_STATES = {
    "active": ("pending", "firing"),
    "firing": ("firing",),
    "pending": ("pending",),
    "resolved": ("resolved",),
}


@router.get(
    "/alerts",
    summary="List alerts",
    response_model=list[AlertOut],
    dependencies=[Reader],
    responses={
        200: {
            "headers": {
                TOTAL_HEADER: {
                    "description": "How many alerts are in the state asked for; the list"
                    f" holds at most {service.MAX_ALERTS} of them.",
                    "schema": {"type": "integer"},
                }
            }
        }
    },
)
def list_alerts(
    session: ReadSession,
    context: Context,
    response: Response,
    state: Literal["active", "firing", "pending", "resolved"] = Query(
        "active", description="active (pending and firing), firing, pending or resolved."
    ),
) -> list[AlertOut]:
    """Alerts, most severe first, each with its culprits and the silences muting it.

    At most 1,000, the most severe and oldest first; the X-Total-Count header says how
    many there are, so a client can tell a cut list from a whole one."""
    states = _STATES[state]
    response.headers[TOTAL_HEADER] = str(service.count_alerts(session=session, states=states))
    return service.list_alerts(
        session=session, states=states, now=context.clock(), limit=service.MAX_ALERTS
    )


@router.get(
    "/silences", summary="List silences", response_model=list[SilenceOut], dependencies=[Reader]
)
def list_silences(
    session: ReadSession,
    context: Context,
    expired: bool = Query(False, description="Include silences that have ended."),
) -> list[SilenceOut]:
    return service.list_silences(session=session, now=context.clock(), include_expired=expired)


class SilenceRoute(AdminFirstRoute):
    """:class:`AdminFirstRoute` (the admin token before the body), answering a body that
    cannot be parsed at all 422 ``json_invalid``, as api.md promises and the ingest
    routes do. FastAPI answers 422 only for a JSONDecodeError; invalid UTF-8, or nesting
    deeper than the parser's recursion, was its own 400, the one 400 of the API."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def handle(request: Request) -> Response:
            try:
                return await handler(request)
            except StarletteHTTPException as err:  # FastAPI raises Starlette's own
                if err.status_code != status.HTTP_400_BAD_REQUEST:
                    raise
                raise RequestValidationError(
                    [{"type": "json_invalid", "loc": ("body",), "msg": "the body is not JSON"}]
                ) from err

        return handle


def create_silence(body: SilenceIn, session: WriteSession, context: Context) -> SilenceOut:
    """Mute alerts matching every matcher until it ends. Silences are stored, so they
    survive restarts and hold on every replica."""
    try:
        created = service.create_silence(session=session, silence=body, now=context.clock())
    except SilenceRefused as err:
        # The shape of every other 422 (api.md): a list of problems, not a string.
        raise RequestValidationError(
            [{"type": "value_error", "loc": ("body", err.field), "msg": str(err)}]
        ) from err
    session.commit()
    return created


router.add_api_route(
    "/silences",
    create_silence,
    methods=["POST"],
    summary="Create a silence",
    response_model=SilenceOut,
    status_code=status.HTTP_201_CREATED,
    dependencies=[Admin],
    route_class_override=SilenceRoute,
)


@router.delete(
    "/silences/{silence_id}",
    summary="Expire a silence",
    response_model=SilenceOut,
    dependencies=[Admin],
    responses={404: {"description": "No such silence."}},
)
def expire_silence(
    session: WriteSession,
    context: Context,
    # Bounded as the column is: an id past 64 bits reached the driver and was a 500.
    silence_id: int = Path(ge=1, le=2**62, description="The id of a silence (GET /silences)."),
) -> SilenceOut:
    try:
        expired = service.expire_silence(
            session=session, silence_id=silence_id, now=context.clock()
        )
    except service.SilenceNotFound as err:
        raise HTTPException(status.HTTP_404_NOT_FOUND, detail=str(err)) from err
    session.commit()
    return expired


@router.get(
    "/receivers",
    summary="Receivers and their delivery state",
    response_model=list[ReceiverOut],
    dependencies=[Reader],
)
def list_receivers(session: ReadSession, context: Context) -> list[ReceiverOut]:
    receivers = {} if context.alerts is None else context.alerts.receivers
    return service.receiver_states(session=session, receivers=receivers)


@router.post(
    "/receivers/{name}/test",
    summary="Send a test notification",
    response_model=TestResult,
    dependencies=[Admin],
    responses={404: {"description": "No receiver of that name."}},
)
def test_receiver(context: Context, name: str = Path(max_length=256, pattern=NO_NUL)) -> TestResult:
    """One attempt with a sample alert; the outcome as the receiver answered it. It is
    logged like any notification, so a receiver a test finds broken shows broken."""
    engine = context.alerts
    if engine is None or name not in engine.receivers:
        raise HTTPException(status.HTTP_404_NOT_FOUND, detail=f"no receiver {name!r}")
    attempt = engine.test_receiver(
        database=context.database,
        name=name,
        external_url=context.settings.alerts.external_url,
        group_by=context.settings.alerts.group_by,
    )
    return TestResult(
        receiver=name,
        outcome=attempt.outcome,
        detail=attempt.detail,
        status_code=attempt.status_code,
    )
