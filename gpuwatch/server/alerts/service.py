"""Reading alerts, managing silences, and the receivers' delivery state."""

from __future__ import annotations

from sqlalchemy import and_, case, func, or_, select, update
from sqlalchemy.orm import Session

from gpuwatch.errors import GpuwatchError
from gpuwatch.server.alerts import dispatch
from gpuwatch.server.alerts.models import AlertRow, NotificationRow, SilenceRow
from gpuwatch.server.alerts.schemas import (
    AlertOut,
    CulpritOut,
    MatcherOut,
    ReceiverOut,
    SilenceIn,
    SilenceOut,
)
from gpuwatch.server.notifications.receivers.base import Receiver

MAX_ALERTS = 1000


class SilenceNotFound(GpuwatchError):
    """No silence with that id (answered 404)."""


def count_alerts(*, session: Session, states: tuple[str, ...]) -> int:
    """How many alerts are in ``states`` (the list stops at :data:`MAX_ALERTS`)."""
    return (
        session.scalar(select(func.count()).select_from(AlertRow).where(AlertRow.state.in_(states)))
        or 0
    )


def list_alerts(
    *, session: Session, states: tuple[str, ...], now: float, limit: int = MAX_ALERTS
) -> list[AlertOut]:
    """Alerts in ``states``, most severe and oldest first, with the silences muting each."""
    silences = _active_silences(session, now)
    rank = case(
        (AlertRow.severity == "critical", 0),
        (AlertRow.severity == "warning", 1),
        (AlertRow.severity == "info", 2),
        else_=3,
    )
    rows = session.scalars(
        select(AlertRow)
        .where(AlertRow.state.in_(states))
        .order_by(rank, AlertRow.active_since, AlertRow.id)
        .limit(limit)
    ).all()
    out = [
        AlertOut(
            id=row.id,
            rule=row.rule,
            state=row.state,  # type: ignore[arg-type]
            severity=row.severity,
            labels=row.labels,
            summary=row.summary,
            description=row.description,
            culprits=[CulpritOut(**c) for c in row.culprits],
            active_since=row.active_since,
            starts_at=row.fired_at,
            ends_at=row.resolved_at,
            silenced_by=[s.id for s in silences if s.mutes(row.labels, now)],
        )
        for row in rows
    ]
    return out


def create_silence(*, session: Session, silence: SilenceIn, now: float) -> SilenceOut:
    """Store ``silence``; :class:`SilenceRefused` when its span is out of bounds."""
    starts, ends = silence.span(now)
    row = SilenceRow(
        matchers=[m.model_dump() for m in silence.matchers],
        starts_at=starts,
        ends_at=ends,
        created_by=silence.created_by,
        comment=silence.comment,
        created_at=now,
    )
    session.add(row)
    session.flush()
    return _silence_out(row, now)


def list_silences(*, session: Session, now: float, include_expired: bool) -> list[SilenceOut]:
    query = select(SilenceRow).order_by(SilenceRow.ends_at.desc(), SilenceRow.id.desc())
    if not include_expired:
        query = query.where(SilenceRow.ends_at > now)
    return [_silence_out(row, now) for row in session.scalars(query.limit(MAX_ALERTS))]


def expire_silence(*, session: Session, silence_id: int, now: float) -> SilenceOut:
    """End a silence now (an expired one stays as it was)."""
    row = session.get(SilenceRow, silence_id)
    if row is None:
        raise SilenceNotFound(f"no silence {silence_id}")
    if row.ends_at > now:
        # One that has not started yet ends before it ever muted anything.
        session.execute(
            update(SilenceRow)
            .where(SilenceRow.id == silence_id)
            .values(starts_at=min(row.starts_at, now), ends_at=now)
        )
        session.refresh(row)
    return _silence_out(row, now)


def receiver_states(*, session: Session, receivers: dict[str, Receiver]) -> list[ReceiverOut]:
    """Each receiver's delivery state: ``broken`` when its latest outcome was a refusal
    for good, ``failing`` when a notification was given up at its deadline since it
    last took one (attempted or not: one that expired in a backlog, or behind a
    ``Retry-After``, counts too) or its latest attempt failed, ``ok`` when it took the
    latest, ``unknown`` before any outcome.

    The latest attempt is that of the newest notification with an outcome recorded:
    a superseded one included (while a receiver is down, each newer notification
    supersedes the retried one and waits, untried, for its retry time), one leased
    for its first attempt and not yet answered not (a receiver that delivers fine read
    ``unknown`` while its next notification was in flight)."""
    out = []
    for name, receiver in sorted(receivers.items()):
        mine = NotificationRow.receiver == name
        # Recorded: settled, or retried after a failed attempt (its last_error kept
        # while it is leased again). Never the first attempt of a row still in flight.
        recorded = or_(
            NotificationRow.status.in_(("sent", "broken", "failed")),
            and_(NotificationRow.attempts > 0, NotificationRow.last_error.is_not(None)),
        )
        last = session.scalars(
            select(NotificationRow)
            .where(mine, recorded)
            .order_by(NotificationRow.id.desc())
            .limit(1)
        ).first()
        sent_at = session.scalar(select(func.max(NotificationRow.sent_at)).where(mine))
        # A failed or broken row's next_attempt_at is when it was settled.
        given_up = select(NotificationRow).where(mine, NotificationRow.status == "failed")
        if sent_at is not None:
            given_up = given_up.where(NotificationRow.next_attempt_at > sent_at)
        failed = session.scalar(select(func.count()).select_from(given_up.subquery())) or 0
        latest_failed = session.scalars(
            given_up.order_by(NotificationRow.next_attempt_at.desc()).limit(1)
        ).first()
        pending = session.scalar(
            select(func.count(NotificationRow.id)).where(mine, NotificationRow.status == "pending")
        )
        superseded = session.scalar(
            select(func.count(NotificationRow.id)).where(
                mine, NotificationRow.status == "superseded"
            )
        )
        status = "unknown"
        last_error = None if last is None else last.last_error
        if last is not None:
            status = {"sent": "ok", "broken": "broken"}.get(last.status, "failing")
        if failed and status != "broken":
            status = "failing"
            if latest_failed is not None and (last is None or last.status == "sent"):
                last_error = latest_failed.last_error
        out.append(
            ReceiverOut(
                name=name,
                type=receiver.type,
                status=status,  # type: ignore[arg-type]
                last_error=last_error,
                last_sent_at=sent_at,
                pending=pending or 0,
                superseded=superseded or 0,
                failed=failed,
            )
        )
    return out


def _active_silences(session: Session, now: float) -> list[dispatch.Silence]:
    rows = session.scalars(
        select(SilenceRow).where(SilenceRow.starts_at <= now, SilenceRow.ends_at > now)
    )
    return [
        dispatch.Silence(
            row.id, dispatch.matchers_from_json(row.matchers), row.starts_at, row.ends_at
        )
        for row in rows
    ]


# The latest time shown (year 2242, the snapshots' Epoch maximum). Silences stored
# before their end was bounded can end at 1e308 or infinity, which JSON cannot carry
# (answered null, refused by clients) and no calendar can print (the /alerts page was a
# 500): they are shown as ending then.
SHOWN_UNTIL = float(2**33)


def _shown(t: float) -> float:
    return t if 0 <= t <= SHOWN_UNTIL else SHOWN_UNTIL if t > 0 else 0.0


def _silence_out(row: SilenceRow, now: float) -> SilenceOut:
    state = "pending" if now < row.starts_at else "active" if now < row.ends_at else "expired"
    return SilenceOut(
        id=row.id,
        # As stored: matchers refused today must still list, so they can be expired.
        matchers=[MatcherOut(**m) for m in row.matchers],
        starts_at=_shown(row.starts_at),
        ends_at=_shown(row.ends_at),
        created_by=row.created_by,
        comment=row.comment,
        created_at=row.created_at,
        state=state,  # type: ignore[arg-type]
    )
