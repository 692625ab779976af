"""One evaluation of the alert engine, and the delivery of what it decided.

:meth:`AlertEngine.run` is a scheduled job (``alerts``, every
``evaluation_interval``): read the fleet's facts and run the rules, then advance every
alert's life cycle, decide the notifications due (grouping, silences, timers) and write
all of that in one transaction; then deliver the pending notifications.

What is promised, and why it holds:

* **Ingest never waits for rules.** The fleet and the alert state are read and judged
  in read transactions; only the alert tables are written under the write lock, in
  chunks (notifications before the groups that record them).
* **Once across replicas.** The job runs under the scheduler's advisory lock, and a
  notification is a row unique per receiver, group and flush time: a second replica
  can neither plan nor send it again.
* **Nothing lost on a restart or a replica change.** Alerts, group timers (the
  notification log) and pending notifications are rows; a restarted server continues
  from them. A replica leaves the notifications of receivers it does not know to the
  replicas that do, and gives them up only past their deadline.
* **At most one duplicate.** Before an attempt the notification is leased (its next
  attempt moved past the attempt's timeout) in its own commit; the outcome is written
  after. A server killed between the two leaves the row pending, and it is sent once
  more when the lease ends.
* **Receivers are never hammered.** One attempt per notification per try; retries
  back off with jitter (honouring ``Retry-After``) until the delivery deadline, sends
  to one receiver are spaced by its ``min_interval_seconds`` (Slack: 1 s), an endpoint
  that asks to wait (429 or 503 with ``Retry-After``) gets nothing more from this
  process until then, and a permanent refusal marks the notification ``broken``
  instead of retrying.
  Alertmanager receivers get their due alerts in batched POSTs (:data:`BATCH_ALERTS`);
  a 400 to a batch is resent in halves, so only the notifications refused on their
  own are ``broken``.
* **The newest word on a group is sent last.** A notification carries its group's
  whole state, so a newer one supersedes the older ones of its receiver and group
  still pending (``superseded``, never sent): a retried ``firing`` can no longer
  follow its ``resolved``.
* **A page that fired before a silence is closed after it.** A group keeps an alert
  muted since it was notified firing as told firing (dispatch), and its resolved row
  outlives ``resolved_retention`` while a receiver is owed that resolution, so it is
  sent when the silence ends, however long the silence.
* **Nothing stale is sent.** A notification not attempted by its deadline is
  ``failed`` without being sent; before an attempt it loses the firing alerts since
  silenced or resolved (``superseded`` when nothing is left).
* **No resolution owed is dropped.** Each group records what its receiver was actually
  told fires (``delivered_firing``, from the notifications sent). A notification given
  up at its deadline makes the group fall back to that record, so the next look tells
  what still fires and resolves what the receiver was told fires and has resolved,
  however long the receiver was down; the resolved row is kept until then.
* **The most urgent first.** A receiver's due notifications are claimed by urgency (its
  most severe alert), then age: a new critical page is not queued behind a backlog.
"""

from __future__ import annotations

import json
import logging
import random
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field, replace
from functools import cache
from typing import Any, NamedTuple

from sqlalchemy import (
    BigInteger,
    String,
    Table,
    and_,
    any_,
    bindparam,
    delete,
    func,
    insert,
    select,
    update,
)
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.orm import Session

from gpuwatch.server.alerts import dispatch, lifecycle, rules
from gpuwatch.server.alerts.config import DEFAULT_GROUP_BY, AlertSettings
from gpuwatch.server.alerts.facts import read_facts
from gpuwatch.server.alerts.lifecycle import AlertState
from gpuwatch.server.alerts.models import AlertGroupRow, AlertRow, NotificationRow, SilenceRow
from gpuwatch.server.database.bulk import execute_arrays
from gpuwatch.server.database.core import Database
from gpuwatch.server.database.dialects import (
    ArraySql,
    insert_ignoring_conflicts,
    unnest_insert,
    unnest_update,
)
from gpuwatch.server.notifications.model import Attempt, Culprit, Notification
from gpuwatch.server.notifications.receivers.base import Receiver
from gpuwatch.server.notifications.receivers.text import cut
from gpuwatch.settings import ServerSettings

log = logging.getLogger(__name__)

BACKOFF_CAP_SECONDS = 60.0
# The longest Retry-After honoured: a receiver that answers "Retry-After: 86400" muted
# its endpoint for a day, and every notification to it expired unattempted. After this
# long it is asked again (and may ask to wait again).
RETRY_AFTER_CAP_SECONDS = 300.0
# A notification's urgency (claimed in this order, then oldest first): its most severe
# alert's.
URGENCY = {"critical": 0, "warning": 1, "info": 2}
# Sent and given-up notifications are kept this long (the log the API shows).
NOTIFICATION_RETENTION_SECONDS = 7 * 86400.0
MAX_ATTEMPTS_PER_RUN = 200
# Receivers that take many notifications per request (Alertmanager): notifications
# claimed per run, and alerts per POST (Prometheus sends Alertmanager batches of 256).
MAX_BATCHED_PER_RUN = 20_000
BATCH_ALERTS = 256
# Rows per statement when notifications are written in bulk (and ids per IN list).
INSERT_CHUNK = 1000
# Notifications, or groups, written per write transaction by an evaluation.
WRITE_CHUNK = 2000
# The share of a run a receiver gets when it has no timeout_seconds of its own (the
# receivers' default timeout).
DEFAULT_TIMEOUT_SECONDS = 10.0
# Marks a test notification's group key in the notification log (after the key it
# was sent with), before a unique suffix, so no alert group ever shares its row.
TEST_LOG_SUFFIX = "test"
_NOTIFICATIONS: Table = NotificationRow.__table__  # type: ignore[assignment]
_GROUPS: Table = AlertGroupRow.__table__  # type: ignore[assignment]
_ALERTS: Table = AlertRow.__table__  # type: ignore[assignment]
# The columns an evaluation writes, in the order of the Postgres array statements.
_NOTIFICATION_COLUMNS = (
    "receiver",
    "group_key",
    "flush_at",
    "status",
    "body",
    "attempts",
    "next_attempt_at",
    "deadline_at",
    "urgency",
)
_GROUP_COLUMNS = (
    "receiver",
    "group_key",
    "group_labels",
    "first_alert_at",
    "flushed_at",
    "notified_at",
    "notified_firing",
    "delivered_firing",
)
_ALERT_COLUMNS = (
    "fingerprint",
    "rule",
    "labels",
    "severity",
    "state",
    "summary",
    "description",
    "culprits",
    "active_since",
    "fired_at",
    "last_true_at",
    "resolved_at",
)
# Columns of the alert tables whose values go to the array statements as JSON text.
_JSON_COLUMNS = frozenset(
    {"body", "group_labels", "notified_firing", "delivered_firing", "labels", "culprits"}
)
# One evaluation at a time per database in this process (by URL).
_EVALUATING: dict[str, threading.Lock] = {}


@dataclass
class RunResult:
    """What one run did: alerts written by state (every alert whose condition still
    holds is rewritten, for its ``last_true_at``; ``dropped``: pending ones that ended
    unheard), notifications planned, and (receiver, outcome) per delivery attempt."""

    written: dict[str, int] = field(default_factory=dict)
    planned: int = 0
    attempts: list[tuple[str, str]] = field(default_factory=list)


class AlertEngine:
    """Holds the receivers (and their HTTP client) and the clock; :meth:`run` is the job."""

    def __init__(
        self,
        *,
        receivers: dict[str, Receiver],
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], None] = time.sleep,
        on_outcome: Callable[[str, str], None] | None = None,
        rng: Callable[[], float] = random.random,
    ) -> None:
        self.receivers = receivers
        self._clock = clock
        self._sleep = sleep
        self._on_outcome = on_outcome
        self._rng = rng
        self._last_sent: dict[str, float] = {}
        # Endpoint -> when it said it would take requests again (Retry-After). Slack's
        # limit is per webhook URL: waiting with only the notification it answered left
        # the others to be sent, and refused, one after another.
        self._paused_until: dict[str, float] = {}

    def run(
        self,
        *,
        database: Database,
        settings: ServerSettings,
        now: float,
        up_since: float | None = None,
    ) -> RunResult:
        """Evaluate and dispatch at ``now``, then deliver what is due. ``up_since``: when
        this server started (see :func:`~gpuwatch.server.alerts.facts.read_facts`)."""
        result = self.evaluate(database=database, settings=settings, now=now, up_since=up_since)
        result.attempts = self.deliver(
            database=database, now=now, lease_seconds=settings.alerts.delivery_lease_seconds
        )
        return result

    def evaluate(
        self,
        *,
        database: Database,
        settings: ServerSettings,
        now: float,
        up_since: float | None = None,
    ) -> RunResult:
        # The state is judged outside the write lock, so two evaluations of one
        # database must not overlap: across replicas the scheduler's advisory lock
        # sees to it, in one process (SQLite) this lock.
        with _EVALUATING.setdefault(database.engine.url.render_as_string(), threading.Lock()):
            return self._evaluate(database=database, settings=settings, now=now, up_since=up_since)

    def _evaluate(
        self, *, database: Database, settings: ServerSettings, now: float, up_since: float | None
    ) -> RunResult:
        config = settings.alerts
        job_ended = config.rules.job_ended
        # Facts are read outside the write transaction: on SQLite a writer holds the one
        # write lock, and ingest must not wait while the fleet is read and judged.
        with database.reader() as session:
            facts = read_facts(
                session=session,
                settings=settings,
                now=now,
                ended_since=now - job_ended.announce_for_seconds if job_ended.enabled else None,
                holders_above=_holders_above(config),
                reaped_since=(
                    now - config.rules.process_reaped.announce_for_seconds
                    if config.rules.process_reaped.enabled
                    else None
                ),
                lookback_seconds=config.rules.gpu_nearly_full.jump_within_seconds,
                up_since=up_since,
            )
        candidates = rules.evaluate(facts, config, now=now)
        # The write lock is held in short turns, so ingest's writers get theirs in
        # between (10,000 groups in one transaction held SQLite's lock for 10 s): the
        # state is read and judged outside it (one evaluation at a time: the
        # scheduler's lock), then written in chunks, notifications before the groups
        # that record them. A crash part way leaves groups as they were: the next
        # evaluation plans their notifications again, superseding the ones written.
        with database.reader() as session:
            active = {a.fingerprint: a for a in _load(session, ("pending", "firing"))}
        changed = lifecycle.advance(active, candidates, config, now=now, sees=facts.sees)
        with database.writer() as session, session.begin():
            _store_alerts(session, changed)
        with database.reader() as session:
            groups = _load_groups(session)
            owed = _told_firing(groups, self.receivers)
            recent = [
                a
                for a in _load(session, ("firing", "resolved"))
                if a.resolved_at is None
                or a.resolved_at >= now - config.resolved_retention_seconds
                or a.fingerprint in owed
            ]
            silences = _load_silences(session, now)
        plan = dispatch.plan(
            recent,
            groups,
            silences,
            [
                dispatch.ReceiverInfo(
                    name,
                    receiver.send_resolved,
                    dispatch.ALERTMANAGER_RESEND_SECONDS
                    if receiver.type == "alertmanager"
                    else None,
                )
                for name, receiver in sorted(self.receivers.items())
            ],
            config,
            now=now,
        )
        planned = 0
        for start in range(0, len(plan.notifications), WRITE_CHUNK):
            chunk = dispatch.Plan(notifications=plan.notifications[start : start + WRITE_CHUNK])
            with database.writer() as session, session.begin():
                planned += _insert_notifications(
                    session,
                    database.dialect,
                    chunk,
                    deadline=now + config.delivery_deadline_seconds,
                )
        for start in range(0, len(plan.groups), WRITE_CHUNK):
            with database.writer() as session, session.begin():
                _store_groups(session, plan.groups[start : start + WRITE_CHUNK])
        with database.writer() as session, session.begin():
            _purge(
                session,
                now=now,
                resolved_before=now - config.resolved_retention_seconds,
                keep=owed,
            )
        counts: dict[str, int] = {}
        for alert in changed:
            state = "dropped" if alert.dropped else alert.state
            counts[state] = counts.get(state, 0) + 1
        return RunResult(written=counts, planned=planned)

    def deliver(
        self, *, database: Database, now: float, lease_seconds: float
    ) -> list[tuple[str, str]]:
        """Attempt every pending notification whose time has come; return (receiver,
        outcome) per notification. Each is claimed for ``lease_seconds`` first (longer
        than an attempt can take, which settings check), so no one else tries it
        meanwhile. One whose delivery deadline has passed is given up (``failed``)
        without being sent: what it says is stale.

        Receiver by receiver, and each only for about its ``timeout_seconds`` per run:
        no new attempt starts once a receiver has used that much, and what it did not
        reach is handed back for the next run. So a slow receiver (each attempt bounded
        by its timeout) delays the others, and the next evaluation, by at most about
        twice its timeout, whatever its backlog; one that answers promptly is not held.

        A receiver that takes many notifications in one request (Alertmanager's
        ``attempt_batch``) gets all of its due notifications in POSTs of at most
        :data:`BATCH_ALERTS` alerts each, one attempt per POST."""
        outcomes: list[tuple[str, str]] = []
        configured = sorted(self.receivers)
        for name in [*configured, None]:  # None: receivers no longer configured
            receiver = self.receivers.get(name) if name is not None else None
            batched = receiver is not None and hasattr(receiver, "attempt_batch")
            limit = MAX_BATCHED_PER_RUN if batched else MAX_ATTEMPTS_PER_RUN
            claimed, expired = self._claim(database, now, lease_seconds, name, configured, limit)
            for row in expired:
                self._outcome(outcomes, row.receiver, "failed")
            units = _chunks(claimed) if batched else [[row] for row in claimed]
            budget = _timeout_of(receiver)
            started = time.monotonic()
            for index, unit in enumerate(units):
                if index and time.monotonic() - started >= budget:
                    self._release(database, [row for rest in units[index:] for row in rest])
                    break
                if self._paused_until.get(self._endpoint(unit[0].receiver), 0.0) > self._clock():
                    # The endpoint asked us to wait: the rest go back, unattempted.
                    self._release(database, [row for rest in units[index:] for row in rest])
                    break
                stale = [row for row in unit if row.deadline < self._clock()]
                if stale:  # its deadline passed while the run was busy with others
                    self._expire(database, stale)
                    for row in stale:
                        self._outcome(outcomes, row.receiver, "failed")
                    unit = [row for row in unit if row.deadline >= self._clock()]
                    if not unit:
                        continue
                for row, outcome in self._send(database, unit):
                    self._outcome(outcomes, row.receiver, outcome)
        return outcomes

    def _send(self, database: Database, unit: list[Claimed]) -> list[tuple[Claimed, str]]:
        """Attempt ``unit`` (one request) and record the outcome of each of its rows.

        A 400 to a batch of several notifications may be about one alert of one of
        them (Alertmanager answers 400 to the whole POST and keeps the valid alerts):
        the batch is then split in halves and each resent, down to single
        notifications, so only the ones refused on their own are ``broken``."""
        attempt = self._attempt(unit[0].receiver, [row.body for row in unit])
        if attempt.outcome == "broken" and attempt.status_code == 400 and len(unit) > 1:
            log.info(
                "receiver %s refused a batch of %d notifications (400): resending in halves",
                unit[0].receiver,
                len(unit),
            )
            half = len(unit) // 2
            return self._send(database, unit[:half]) + self._send(database, unit[half:])
        return list(zip(unit, self._record(database, unit, attempt), strict=True))

    def _outcome(self, outcomes: list[tuple[str, str]], receiver: str, outcome: str) -> None:
        outcomes.append((receiver, outcome))
        if self._on_outcome is not None:
            self._on_outcome(receiver, outcome)

    def _claim(
        self,
        database: Database,
        now: float,
        lease_seconds: float,
        name: str | None,
        configured: list[str],
        limit: int = MAX_ATTEMPTS_PER_RUN,
    ) -> tuple[list[Claimed], list[Claimed]]:
        """Lease the due notifications of receiver ``name`` (None: of every receiver
        not in ``configured``), oldest first; those whose deadline has passed are
        marked ``failed`` instead. (leased, expired)."""
        # Another replica may know a receiver this one does not (a rolling change of
        # configuration): its notifications are left to it, and only given up here
        # once their deadline has passed (no replica had that receiver in time).
        mine = (
            NotificationRow.receiver == name
            if name is not None
            else and_(
                NotificationRow.receiver.not_in(configured), NotificationRow.deadline_at < now
            )
        )
        with database.writer() as session, session.begin():
            due = session.scalars(
                select(NotificationRow)
                .where(
                    NotificationRow.status == "pending",
                    NotificationRow.next_attempt_at <= now,
                    mine,
                )
                # Most urgent first, then oldest: a new critical page is not queued
                # behind a backlog of warnings (one Slack message a second).
                .order_by(NotificationRow.urgency, NotificationRow.id)
                .limit(limit)
                .with_for_update(skip_locked=True)
            ).all()
            claimed, expired = [], []
            ended: set[str] = set()
            silences: list[dispatch.Silence] = []
            if due:
                states = session.execute(
                    select(AlertRow.fingerprint, AlertRow.state).where(
                        AlertRow.state.in_(("firing", "resolved"))
                    )
                ).all()
                firing = {f for f, state in states if state == "firing"}
                ended = {f for f, state in states if state == "resolved"} - firing
                silences = _load_silences(session, now)
            dropped = 0
            for row in due:
                if row.deadline_at < now:
                    row.status = "failed"
                    row.last_error = _expired_error(row.last_error)
                    row.next_attempt_at = now  # a settled row: when it was given up
                    expired.append(_claimed(row, row.body))
                    continue
                body = _still_due(row.body, ended, silences, now)
                if body is None:  # nothing in it is still to be told
                    row.status = "superseded"
                    dropped += 1
                    continue
                if body is not row.body:
                    row.body = body
                claimed.append(_claimed(row, body))
                row.attempts += 1
                row.next_attempt_at = now + lease_seconds
            _retell(session, expired)
        if dropped:
            log.info(
                "receiver %s: %d pending notifications dropped, their alerts since resolved"
                " or silenced",
                name,
                dropped,
            )
        for item in expired:
            log.warning("notification %d: its deadline passed before an attempt", item.id)
        return claimed, expired

    def _release(self, database: Database, rows: list[Claimed]) -> None:
        """Hand back claimed notifications not attempted: as they were before the claim."""
        if not rows:
            return
        with database.writer() as session, session.begin():
            session.execute(
                update(NotificationRow),
                [{"id": r.id, "attempts": r.attempts, "next_attempt_at": r.due} for r in rows],
            )

    def _expire(self, database: Database, rows: list[Claimed]) -> None:
        """Give up claimed notifications whose deadline passed before their attempt."""
        with database.writer() as session, session.begin():
            _retell(session, rows)
            session.execute(
                update(NotificationRow),
                [
                    {
                        "id": r.id,
                        "attempts": r.attempts,
                        "status": "failed",
                        "last_error": _expired_error(r.last_error),
                        "next_attempt_at": self._clock(),  # when it was given up
                    }
                    for r in rows
                ],
            )
        for row in rows:
            log.warning("notification %d: its deadline passed before an attempt", row.id)

    def test_receiver(
        self,
        *,
        database: Database,
        name: str,
        external_url: str | None = None,
        group_by: Sequence[str] = DEFAULT_GROUP_BY,
    ) -> Attempt:
        """Send a sample notification to receiver ``name`` once (``alerts test-receiver``),
        and log it like any notification, so the receiver's state and counters show it.
        ``external_url`` and ``group_by`` are the server's, so the sample carries the
        link and the ``group_key`` format real notifications do."""
        now = self._clock()
        sample = sample_notification(name, now, external_url=external_url, group_by=group_by)
        body = sample.to_json()
        attempt = self._attempt(name, [body])
        status = {"sent": "sent", "broken": "broken"}.get(attempt.outcome, "failed")
        with database.writer() as session, session.begin():
            session.add(
                NotificationRow(
                    receiver=name,
                    # Each test its own row, even two in the same second.
                    group_key=dispatch.bounded_key(
                        f"{sample.group_key} {TEST_LOG_SUFFIX} {uuid.uuid4().hex}"
                    ),
                    flush_at=now,
                    status=status,
                    body=body,
                    attempts=1,
                    next_attempt_at=now,
                    deadline_at=now,
                    sent_at=now if status == "sent" else None,
                    last_error=None if status == "sent" else attempt.detail[:512],
                )
            )
        if self._on_outcome is not None:
            self._on_outcome(name, attempt.outcome)
        return attempt

    def _attempt(self, name: str, bodies: list[dict[str, object]]) -> Attempt:
        """One attempt of ``bodies`` (several only for a receiver with ``attempt_batch``),
        spaced from the previous send to the same endpoint by ``min_interval_seconds``."""
        receiver = self.receivers.get(name)
        if receiver is None:
            return Attempt("broken", f"receiver {name!r} is no longer configured")
        key = self._endpoint(name)
        wait = self._last_sent.get(key, float("-inf")) + receiver.min_interval_seconds
        if wait > self._clock():
            self._sleep(wait - self._clock())
        try:
            notifications = [Notification.from_json(body) for body in bodies]
            if len(notifications) == 1:
                attempt = receiver.attempt(notifications[0])
            else:
                attempt = receiver.attempt_batch(notifications)  # type: ignore[attr-defined]
        except Exception as err:  # a receiver bug must not stop the others
            log.exception("receiver %s failed unexpectedly", name)
            attempt = Attempt("retry", f"receiver {name!r} failed: {type(err).__name__}")
        self._last_sent[key] = self._clock()
        if attempt.retry_after is not None and attempt.retry_after > RETRY_AFTER_CAP_SECONDS:
            attempt = replace(attempt, retry_after=RETRY_AFTER_CAP_SECONDS)
        if attempt.outcome == "retry" and attempt.retry_after is not None:
            self._paused_until[key] = self._clock() + attempt.retry_after
        return attempt

    def _endpoint(self, name: str) -> str:
        """What spacing and Retry-After apply to: the endpoint (Slack's limit is per
        webhook URL), not the receiver's name, so two receivers on one URL share it."""
        return getattr(self.receivers.get(name), "spacing_key", name)

    def _record(self, database: Database, rows: list[Claimed], attempt: Attempt) -> list[str]:
        """Write what ``attempt`` came to for each of ``rows``; the outcome of each."""
        now = self._clock()
        error = None if attempt.outcome == "sent" else attempt.detail[:512]
        values: list[dict[str, object]] = []
        outcomes: list[str] = []
        for row in rows:
            value: dict[str, object] = {"id": row.id, "last_error": error}
            if attempt.outcome == "sent":
                value |= {"status": "sent", "sent_at": now}
                outcome = "sent"
            elif attempt.outcome == "broken":
                value |= {"status": "broken", "next_attempt_at": now}
                outcome = "broken"
                log.warning(
                    "notification %d: receiver refused it for good: %s", row.id, attempt.detail
                )
            else:
                attempts = row.attempts + 1
                backoff = min(BACKOFF_CAP_SECONDS, 2.0 ** (attempts - 1)) * (0.5 + self._rng())
                wait = attempt.retry_after if attempt.retry_after is not None else backoff
                next_at = now + wait
                if next_at > row.deadline:
                    value |= {"status": "failed", "next_attempt_at": now}
                    outcome = "failed"
                    log.warning(
                        "notification %d: gave up at its deadline: %s", row.id, attempt.detail
                    )
                else:
                    value |= {"status": "pending", "next_attempt_at": next_at}
                    outcome = "retry"
            values.append(value)
            outcomes.append(outcome)
        with database.writer() as session, session.begin():
            # Grouped by the columns written: an executemany per shape.
            shapes: dict[tuple[str, ...], list[dict[str, object]]] = {}
            for value in values:
                shapes.setdefault(tuple(sorted(value)), []).append(value)
            for same in shapes.values():
                session.execute(update(NotificationRow), same)
            _retell(session, [r for r, o in zip(rows, outcomes, strict=True) if o == "failed"])
            _record_delivered(
                session,
                [(r, o) for r, o in zip(rows, outcomes, strict=True) if o in ("sent", "broken")],
            )
        return outcomes


class Claimed(NamedTuple):
    """A notification leased for an attempt, as it was before the lease."""

    id: int
    receiver: str
    body: dict[str, object]
    attempts: int
    deadline: float
    due: float
    last_error: str | None


def _claimed(row: NotificationRow, body: dict[str, Any]) -> Claimed:
    return Claimed(
        row.id,
        row.receiver,
        body,
        row.attempts,
        row.deadline_at,
        row.next_attempt_at,
        row.last_error,
    )


def _still_due(
    body: dict[str, Any], ended: set[str], silences: list[dispatch.Silence], now: float
) -> dict[str, Any] | None:
    """What a pending notification is still to tell at ``now``: ``body`` itself, or
    without the firing alerts that no longer fire (``ended``: resolved since it was
    planned, and not firing again: a
    receiver without ``send_resolved`` gets no resolved notification to supersede it)
    or are now silenced; None when nothing is left. Resolutions are kept."""
    alerts = body.get("alerts", [])
    kept = [
        alert
        for alert in alerts
        if alert.get("status") != "firing"
        or (
            alert.get("fingerprint") not in ended
            and not any(s.mutes(alert.get("labels") or {}, now) for s in silences)
        )
    ]
    if len(kept) == len(alerts):
        return body
    if not kept:
        return None
    status = "firing" if any(a.get("status") == "firing" for a in kept) else "resolved"
    return {**body, "alerts": kept, "status": status}


def _retell(session: Session, given_up: Sequence[Claimed]) -> None:
    """Forget what the groups of notifications given up on (their delivery deadline
    passed) were planned to tell: they fall back to what their receiver was actually
    told (``delivered_firing``), and their next look tells what fires again, and the
    resolution of every alert the receiver was told fires and has resolved since.

    The group was marked told when the notification was planned, so a receiver down
    past the deadline heard nothing more until ``repeat_interval`` (4 h), though the
    alert fired all along; Alertmanager records a group only once a send succeeded.
    Clearing the record altogether lost the resolutions owed: a receiver told "firing",
    down while the alert resolved and past the deadline, never heard "resolved" (a
    page left open for good). A broken notification is not retold: the receiver
    refused it for good, and it would be refused again."""
    for receiver, group_key in {(r.receiver, r.body.get("group_key")) for r in given_up}:
        session.execute(
            update(AlertGroupRow)
            .where(AlertGroupRow.receiver == receiver, AlertGroupRow.group_key == group_key)
            .values(notified_at=None, notified_firing=AlertGroupRow.delivered_firing)
        )


def _record_delivered(session: Session, settled: Sequence[tuple[Claimed, str]]) -> None:
    """Record in each group what its receiver now believes fires: a sent notification's
    firing alerts are added, its resolved ones removed. A broken one (refused for good)
    settles the resolutions it carried: retrying them would be refused again, and an
    owed resolution keeps its alert row."""
    changes: dict[tuple[str, str], tuple[set[str], set[str]]] = {}
    for row, outcome in settled:
        group_key = row.body.get("group_key")
        if not isinstance(group_key, str):
            continue
        told, ended = changes.setdefault((row.receiver, group_key), (set(), set()))
        for alert in row.body.get("alerts") or []:  # type: ignore[attr-defined]
            fingerprint = alert.get("fingerprint")
            if alert.get("status") == "resolved":
                ended.add(fingerprint)
                told.discard(fingerprint)
            elif outcome == "sent":
                told.add(fingerprint)
                ended.discard(fingerprint)
    if not changes:
        return
    values = []
    group_keys = sorted({key for _, key in changes})
    for start in range(0, len(group_keys), INSERT_CHUNK):
        rows = session.execute(
            select(AlertGroupRow.id, AlertGroupRow.receiver, AlertGroupRow.group_key,
                   AlertGroupRow.delivered_firing)
            .where(AlertGroupRow.group_key.in_(group_keys[start : start + INSERT_CHUNK]))
        ).all()  # fmt: skip
        for id_, receiver, group_key, delivered in rows:
            change = changes.get((receiver, group_key))
            if change is None:
                continue
            told, ended = change
            new = sorted((set(delivered or []) - ended) | told)
            if new != sorted(delivered or []):
                values.append({"id": id_, "delivered_firing": new})
    if values:
        session.execute(update(AlertGroupRow), values)


def _urgency(body: dict[str, Any]) -> int:
    """:data:`URGENCY` of a notification body's most severe alert (firing or resolved)."""
    return min(
        (
            URGENCY.get(str((alert.get("labels") or {}).get("severity")), 2)
            for alert in body.get("alerts") or []
        ),
        default=2,
    )


def _expired_error(previous: str | None) -> str:
    text = "given up: its delivery deadline passed before an attempt"
    if previous:
        text += f" (last error: {previous})"
    return text[:512]


def _alert_count(body: dict[str, object]) -> int:
    alerts = body.get("alerts")
    return len(alerts) if isinstance(alerts, list) else 1


def _chunks(rows: list[Claimed]) -> list[list[Claimed]]:
    """``rows`` in order, cut into units of at most :data:`BATCH_ALERTS` alerts (a
    notification with more goes alone)."""
    units: list[list[Claimed]] = []
    size = 0
    for row in rows:
        count = _alert_count(row.body)
        if not units or size + count > BATCH_ALERTS:
            units.append([])
            size = 0
        units[-1].append(row)
        size += count
    return units


def _timeout_of(receiver: Receiver | None) -> float:
    """A receiver's ``timeout_seconds`` (its configuration's), or the default."""
    config = getattr(receiver, "config", None)
    return float(getattr(config, "timeout_seconds", DEFAULT_TIMEOUT_SECONDS))


def _holders_above(config: AlertSettings) -> float:
    """The used share above which a GPU's holders and recent low are read: the nearly-full
    rule names the largest holders of such GPUs (other rules read theirs by event)."""
    rule = config.rules.gpu_nearly_full
    return rule.used_ratio if rule.enabled else 2.0


def sample_notification(
    receiver: str,
    now: float,
    *,
    external_url: str | None = None,
    group_by: Sequence[str] = DEFAULT_GROUP_BY,
) -> Notification:
    """What ``alerts test-receiver`` sends: a plausible filling-up alert, marked a test
    (rule ``test``), grouped by ``group_by`` as a real alert would be: a consumer that
    parses ``group_key`` (``{rule='test',hostname='gpuwatch-test'}``) can check that too."""
    from gpuwatch.server.notifications.model import NotifiedAlert

    labels = {"rule": "test", "severity": "info", "hostname": "gpuwatch-test", "gpu": "0"}
    alert = NotifiedAlert(
        rule="test",
        status="firing",
        labels=labels,
        summary="Test notification from gpuwatch: this receiver works",
        description="alice's pid 4242 (python train.py) holds 20.0 GiB, +1.0 GiB/min",
        starts_at=now,
        ends_at=None,
        fingerprint=rules.fingerprint(labels),
        culprits=[
            Culprit(4242, "alice", "python train.py", 20 * 2**30, slope_bytes_per_second=2**30 / 60)
        ],
    )
    group_key, group_labels = dispatch.group_of(labels, list(group_by))
    return Notification(
        receiver, group_key, group_labels, "firing", [alert], external_url=external_url
    )


def _load(session: Session, states: tuple[str, ...]) -> list[AlertState]:
    rows = session.scalars(select(AlertRow).where(AlertRow.state.in_(states))).all()
    return [
        AlertState(
            fingerprint=row.fingerprint,
            rule=row.rule,
            labels=row.labels,
            severity=row.severity,
            state=row.state,
            summary=row.summary,
            description=row.description,
            culprits=[Culprit(**c) for c in row.culprits],
            active_since=row.active_since,
            last_true_at=row.last_true_at,
            fired_at=row.fired_at,
            resolved_at=row.resolved_at,
            id=row.id,
        )
        for row in rows
    ]


def _store_alerts(session: Session, changed: list[AlertState]) -> None:
    """Write the alerts that changed: one DELETE, one INSERT and one UPDATE executemany,
    however many there are (every active alert changes each round: ``last_true_at``)."""
    dropped = [a.id for a in changed if a.dropped and a.id is not None]
    if dropped:
        session.execute(delete(AlertRow).where(AlertRow.id.in_(dropped)))
    new = [_alert_values(a) for a in changed if not a.dropped and a.id is None]
    updated = [{"id": a.id, **_alert_values(a)} for a in changed if not a.dropped and a.id]
    connection = session.connection()
    if connection.dialect.name == "postgresql":
        # One statement each over arrays: every firing alert is updated every round.
        inserting, updating = _alert_arrays()
        if new:
            execute_arrays(connection, inserting, _array_rows(new, _ALERT_COLUMNS))
        if updated:
            execute_arrays(connection, updating, _array_rows(updated, ("id", *_ALERT_COLUMNS)))
        return
    if new:
        session.execute(insert(AlertRow), new)
    if updated:
        session.execute(update(AlertRow), updated)


def _alert_values(alert: AlertState) -> dict[str, object]:
    return {
        "fingerprint": alert.fingerprint,
        "rule": alert.rule,
        "labels": alert.labels,
        "severity": alert.severity,
        "state": alert.state,
        # Cut to the columns' widths, never inside an escape printable() wrote.
        "summary": cut(alert.summary, 1024),
        "description": cut(alert.description, 2048),
        "culprits": alert.culprits_json(),
        "active_since": alert.active_since,
        "fired_at": alert.fired_at,
        "last_true_at": alert.last_true_at,
        "resolved_at": alert.resolved_at,
    }


def _load_groups(session: Session) -> dict[tuple[str, str], dispatch.GroupState]:
    return {
        (row.receiver, row.group_key): dispatch.GroupState(
            receiver=row.receiver,
            group_key=row.group_key,
            group_labels=row.group_labels,
            first_alert_at=row.first_alert_at,
            flushed_at=row.flushed_at,
            notified_at=row.notified_at,
            notified_firing=tuple(row.notified_firing),
            id=row.id,
            delivered_firing=tuple(row.delivered_firing or ()),
        )
        for row in session.scalars(select(AlertGroupRow))
    }


def _store_groups(session: Session, groups: list[dispatch.GroupState]) -> None:
    """Write the groups whose state moved (new ones inserted, others in one executemany)."""
    values = [
        {
            "id": group.id,
            "receiver": group.receiver,
            "group_key": group.group_key,
            "group_labels": group.group_labels,
            "first_alert_at": group.first_alert_at,
            "flushed_at": group.flushed_at,
            "notified_at": group.notified_at,
            "notified_firing": list(group.notified_firing),
            "delivered_firing": list(group.delivered_firing),
        }
        for group in groups
    ]
    new = [{k: v for k, v in row.items() if k != "id"} for row in values if row["id"] is None]
    changed = [row for row in values if row["id"] is not None]
    connection = session.connection()
    if connection.dialect.name == "postgresql":
        # One statement each over arrays, not an executemany of a statement per row.
        inserting, updating = _group_arrays()
        if new:
            execute_arrays(connection, inserting, _array_rows(new, _GROUP_COLUMNS))
        if changed:
            execute_arrays(connection, updating, _array_rows(changed, ("id", *_GROUP_COLUMNS)))
        return
    if new:
        session.execute(insert(AlertGroupRow), new)
    if changed:
        session.execute(update(AlertGroupRow), changed)


def _load_silences(session: Session, now: float) -> list[dispatch.Silence]:
    rows = session.scalars(
        select(SilenceRow).where(SilenceRow.starts_at <= now, SilenceRow.ends_at > now)
    ).all()
    return [
        dispatch.Silence(
            row.id, dispatch.matchers_from_json(row.matchers), row.starts_at, row.ends_at
        )
        for row in rows
    ]


def _insert_notifications(
    session: Session, dialect: str, plan: dispatch.Plan, *, deadline: float
) -> int:
    """Insert the planned notifications; each supersedes the older pending ones of its
    receiver and group. The number inserted (one planned twice at one flush time, by
    a replica that lost the race, is not).

    A notification carries its group's whole state (every firing alert, and the
    resolutions not yet told), so an older one still pending says nothing the newer
    one does not, and sending it after the newer one would undo it (a firing retried
    after its resolution). The older ones become ``superseded``, never sent; the
    resolutions they carried that the newer one does not are carried over, and the
    newer one waits for a retry time the receiver asked the older one to keep.

    In bulk: the older rows are read, the new ones inserted and the older ones
    superseded in a few statements of :data:`INSERT_CHUNK` rows each, not one
    statement per notification (10,000 groups used to hold SQLite's write lock for
    six seconds here)."""
    if not plan.notifications:
        return 0
    keys = {(n.receiver, n.group_key) for n, _ in plan.notifications}
    older: dict[tuple[str, str], list[NotificationRow]] = {}
    for row in _pending_of(session, dialect, keys):
        older.setdefault((row.receiver, row.group_key), []).append(row)
    values: list[dict[str, object]] = []
    prior_of: dict[tuple[str, str, float], list[int]] = {}
    for notification, flush_at in plan.notifications:
        key = (notification.receiver, notification.group_key)
        prior = sorted(
            (row for row in older.get(key, []) if row.flush_at < flush_at), key=lambda r: r.id
        )
        body = notification.to_json()
        shown = {alert["fingerprint"] for alert in body["alerts"]}
        for row in reversed(prior):  # the newest word on each alert
            for alert in row.body.get("alerts", []):
                if alert.get("status") == "resolved" and alert.get("fingerprint") not in shown:
                    body["alerts"].append(alert)
                    shown.add(alert.get("fingerprint"))
        # Every prior row's not-before time, tried or not: an untried one may carry a
        # Retry-After from the row it superseded in turn.
        next_at = max([flush_at] + [row.next_attempt_at for row in prior])
        values.append(
            {
                "receiver": notification.receiver,
                "group_key": key[1],
                "flush_at": flush_at,
                "status": "pending",
                "body": body,
                "attempts": 0,
                "next_attempt_at": next_at,
                "deadline_at": deadline,
                "urgency": _urgency(body),
            }
        )
        prior_of[(key[0], key[1], flush_at)] = [row.id for row in prior]
    inserted = 0
    superseded: list[int] = []
    # Only the rows actually inserted come back (RETURNING skips a conflict), so the
    # count is exact on both databases (Postgres' rowcount of an executemany is -1).
    for receiver, group_key, flush_at in _insert_returning_keys(session, dialect, values):
        inserted += 1
        superseded += prior_of.get((receiver, group_key, flush_at), [])
    # On Postgres the ids go as one array (one statement), elsewhere as IN lists.
    step = max(1, len(superseded)) if dialect == "postgresql" else INSERT_CHUNK
    for start in range(0, len(superseded), step):
        ids = superseded[start : start + step]
        session.execute(
            update(NotificationRow)
            .where(
                NotificationRow.id == any_(bindparam("ids", ids, type_=ARRAY(BigInteger)))
                if dialect == "postgresql"
                else NotificationRow.id.in_(ids),
                NotificationRow.status == "pending",
            )
            .values(status="superseded"),
            execution_options={"synchronize_session": False},
        )
    return inserted


def _pending_of(
    session: Session, dialect: str, keys: set[tuple[str, str]]
) -> list[NotificationRow]:
    """The pending notifications of the (receiver, group key) pairs ``keys``.

    On Postgres, one statement joined to the pairs as arrays, so only those pairs' rows
    are read (through the unique index). Looked up by group key alone, in lists of
    :data:`INSERT_CHUNK`, each group key also brought the pending rows of every other
    receiver of that group, bodies and all: 10,000 groups of three receivers read
    60,000 rows it then threw away (4 s of the first evaluation on Postgres)."""
    if dialect == "postgresql":
        pairs = sorted(keys)
        wanted = (
            func.unnest(
                bindparam("receivers", [r for r, _ in pairs], type_=ARRAY(String)),
                bindparam("group_keys", [k for _, k in pairs], type_=ARRAY(String)),
            )
            .table_valued("receiver", "group_key")
            .render_derived()
        )
        return list(
            session.scalars(
                select(NotificationRow).join(
                    wanted,
                    and_(
                        NotificationRow.receiver == wanted.c.receiver,
                        NotificationRow.group_key == wanted.c.group_key,
                        NotificationRow.status == "pending",
                    ),
                )
            )
        )
    found: list[NotificationRow] = []
    group_keys = sorted({k for _, k in keys})
    for start in range(0, len(group_keys), INSERT_CHUNK):
        for row in session.scalars(
            select(NotificationRow).where(
                NotificationRow.status == "pending",
                NotificationRow.group_key.in_(group_keys[start : start + INSERT_CHUNK]),
            )
        ):
            if (row.receiver, row.group_key) in keys:
                found.append(row)
    return found


def _insert_returning_keys(
    session: Session, dialect: str, values: list[dict[str, object]]
) -> Iterable[Any]:
    """Insert notification rows unless already there (same receiver, group and flush
    time); the (receiver, group_key, flush_at) of those inserted.

    On Postgres, one statement over arrays: Core's executemany with RETURNING sends
    INSERTs of 1,000 rows of 8 parameters each, which Postgres parses and plans one by
    one, and SQLAlchemy processes every JSON body on the way: 10,000 groups (30,000
    notifications) took about 7 s of the 15 s evaluation interval (bench/README.md,
    alerts). SQLite keeps Core's statement, in chunks of :data:`INSERT_CHUNK`."""
    connection = session.connection()
    if dialect == "postgresql":
        rows = _array_rows(values, _NOTIFICATION_COLUMNS)
        return execute_arrays(connection, _notification_arrays(), rows).all()
    statement = insert_ignoring_conflicts(_NOTIFICATIONS, dialect).returning(
        _NOTIFICATIONS.c.receiver, _NOTIFICATIONS.c.group_key, _NOTIFICATIONS.c.flush_at
    )
    return [
        row
        for start in range(0, len(values), INSERT_CHUNK)
        for row in connection.execute(statement, values[start : start + INSERT_CHUNK])
    ]


@cache
def _notification_arrays() -> ArraySql:
    return unnest_insert(
        _NOTIFICATIONS, _NOTIFICATION_COLUMNS, returning=("receiver", "group_key", "flush_at")
    )


@cache
def _group_arrays() -> tuple[ArraySql, ArraySql]:
    """(insert, update by id) of group rows, over arrays. A group that is already there
    when it is inserted (only a second evaluation running at once could have written
    it, which the scheduler's lock rules out) takes the newer state."""
    columns = [c for c in _GROUP_COLUMNS if c not in ("receiver", "group_key")]
    return (
        unnest_insert(_GROUPS, _GROUP_COLUMNS, key=("receiver", "group_key"), update=columns),
        unnest_update(_GROUPS, ("id", *_GROUP_COLUMNS), key="id", param="id"),
    )


@cache
def _alert_arrays() -> tuple[ArraySql, ArraySql]:
    """(insert, update by id) of alert rows, over arrays (alerts have no key but their
    id, so the insert's ``ON CONFLICT DO NOTHING`` never applies)."""
    return (
        unnest_insert(_ALERTS, _ALERT_COLUMNS),
        unnest_update(_ALERTS, ("id", *_ALERT_COLUMNS), key="id", param="id"),
    )


def _array_rows(
    values: Sequence[Mapping[str, Any]], names: tuple[str, ...]
) -> list[tuple[Any, ...]]:
    """``values`` as tuples of ``names``, with JSON columns as the text SQLAlchemy's JSON
    type would have written (the array statements take values as the driver sends them)."""
    return [
        tuple(json.dumps(value[n]) if n in _JSON_COLUMNS else value[n] for n in names)
        for value in values
    ]


def _told_firing(
    groups: dict[tuple[str, str], dispatch.GroupState], receivers: dict[str, Receiver]
) -> set[str]:
    """The fingerprints a configured receiver was last told fire, as planned or as
    delivered. A resolved one is owed its resolution, which may wait for as long as a
    silence holds it (up to a year), or as long as the receiver is down (its
    notification given up at the deadline, and planned again): its row is kept past
    ``resolved_retention`` until then. (Groups of receivers no longer configured are
    never looked at again, so they pin nothing.)"""
    return {
        fingerprint
        for (receiver, _), group in groups.items()
        if receiver in receivers
        for fingerprint in (*group.notified_firing, *group.delivered_firing)
    }


def _purge(
    session: Session, *, now: float, resolved_before: float, keep: AbstractSet[str] = frozenset()
) -> None:
    """Delete resolved alerts past their retention, except those whose fingerprint is
    in ``keep`` (a receiver is still owed their resolution), and old notifications."""
    old = session.execute(
        select(AlertRow.id, AlertRow.fingerprint).where(
            AlertRow.state == "resolved", AlertRow.resolved_at < resolved_before
        )
    ).all()
    ids = [id_ for id_, fingerprint in old if fingerprint not in keep]
    for start in range(0, len(ids), INSERT_CHUNK):
        session.execute(delete(AlertRow).where(AlertRow.id.in_(ids[start : start + INSERT_CHUNK])))
    session.execute(
        delete(NotificationRow).where(
            NotificationRow.status != "pending",
            NotificationRow.flush_at < now - NOTIFICATION_RETENTION_SECONDS,
        )
    )
