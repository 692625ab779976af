"""The ingest writer: threads that store this process's pushes, several to a transaction.

Why writer threads and shared transactions, rather than each push in a worker thread
and a transaction of its own (stop 11's design):

* **What a transaction costs, paid once per batch.** Pushes queued while a
  transaction ran are stored together in the next one, so its start, its session, its
  commit and the statements' fixed costs are shared. Under no load a batch is one push
  and nothing waits for company; under load batches grow by themselves. In process,
  200 hosts pushing at once: 0.71x the CPU per snapshot on SQLite, 0.58x on Postgres
  (bench/writer.py).
* **Threads fought over the GIL.** Each push held one of anyio's 40 worker threads;
  on SQLite all but one waited for the write turn anyway, and every thread's wake-up
  and answer cost the event loop a switch (py-spy: a third of the server's samples
  under load were the worker threads waking the event loop). A writer parses and
  stores, and answers a batch with one wake-up.

Every push keeps its own answer. A refusal that writes nothing (the token revoked,
the budget spent, a clock too far ahead) is answered on its own and the batch goes
on. Anything else that fails inside the shared transaction rolls the transaction
back: every push that had written is stored again in a transaction of its own, and
those not reached wait for the next batch, so one push's bad data or bug never costs
another push its answer. An outage (the database gone, the write turn not coming) is
every push's answer, since a retry alone would meet it too. Refusals are answered at
once, not after the batch.

Order: a batch stores its pushes in the order they came (so a host's own pushes keep
theirs), and what it has no time for goes back to the front of the queue, oldest
first: no push is passed over for ever by later ones. On Postgres a batch of several
hosts first locks their tokens' rows (``FOR SHARE``, which a revoke waits for) and
then their host rows (``FOR UPDATE``), each in id order, in one statement: two
replicas' batches locking the same hosts in different orders could deadlock, one
order cannot, and tokens before hosts is the order of every writer (deps.py,
:func:`~gpuwatch.server.deps.confirm_push`).

Time: a batch takes new pushes only until it has run :data:`BATCH_SECONDS`, and none
once the time budget of a push waiting for its commit has passed; the rest wait for
the next one. It waits for its write turn (SQLite) or, once its pushes have queued,
its hosts' locks (Postgres) no longer than the earliest budget among its pushes: then
those out of budget are answered 503 and the rest wait for the next batch, rather than
a turn held by a job adding its wait to the time they queued (past the agent's 10 s
timeout). Each push's budget (ingest/body.py, ``Deadline``) is read where stop 11 read
it: before its parse, once its write has its turn, then before each snapshot after the
first (a partial answer) when the agent accepts one, where the earliest budget among
the pushes waiting for the commit counts too. And the request reads it itself
(:meth:`IngestWriter.store`): a push still queued when its budget passes is answered
503 then, whatever the writer is doing, and the writer skips it (:meth:`Push.claim`);
a push the writer has begun storing gets its real answer, whose cost the bounds on
one push's work keep near its budget (ingest/work.py). Before, a push queued behind a
batch that took 13 s was answered 503 when the writer got to it, past the agent's
timeout.

Threads: a thread takes at most its even share of the pushes waiting with the threads
that are idle (:class:`Pending`). On SQLite, under load (pushes less than
:data:`LINGER_SECONDS` apart), the thread that finds less than a full batch first
waits until the oldest push has queued that long, so the batch's fixed costs are
shared; otherwise it starts at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from fastapi import HTTPException, Response, status
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from sqlalchemy.orm import Session

from gpuwatch.server.database.core import describe, is_unavailable, is_wait_timeout
from gpuwatch.server.deps import (
    PushCredential,
    ServerContext,
    confirm_push,
    forbid_other_host,
    lock_push_tokens,
    reverify_push,
)
from gpuwatch.server.ingest import service, work
from gpuwatch.server.ingest.body import STORE_ERRORS, Deadline, never_storable, refusal
from gpuwatch.server.ingest.state import lock_hosts
from gpuwatch.server.metrics import AHEAD_WINDOW_SECONDS
from gpuwatch.wire import CLOCK_SKEW_PROBLEM, IngestRequest, IngestResponse

log = logging.getLogger(__name__)

# A batch takes no more pushes once it has run this long (its commit still follows):
# long enough to share a commit among dozens of small pushes, short against the 5 s
# time budget and the agent's 10 s timeout.
BATCH_SECONDS = 0.1
# Pushes waiting when a batch starts that it may take at most, however quick.
BATCH_PUSHES = 64
# How long a batch waits for company before it starts, once pushes arrive more often
# than this (Nagle's algorithm, or a database's group commit): what a transaction
# costs whatever it stores (begin, commit, a wake-up of the event loop, about 0.4 ms of
# CPU on SQLite, bench/writer.py) is then shared by several pushes, not paid by each.
# At 200 pushes/s a batch gathers about four, for at most this much more latency;
# under no load nothing waits. SQLite only: on Postgres the writer threads would split
# what they gathered between them, and each would still pay for its own transaction.
LINGER_SECONDS = {"sqlite": 0.02, "postgresql": 0.0}
# How long a batch's oldest push may have queued before a Postgres batch bounds its
# lock waits by that push's budget (see IngestWriter._wait_limit).
QUEUED_SECONDS = 0.5
# Writer threads per process. SQLite has one writer whatever we do. Postgres takes two:
# a push there is mostly round trips (8.7 ms of wall time to 4.4 ms of CPU,
# bench/writer.py), and one thread alone fell behind 200 pushes/s waiting on the
# network, while four fought over the GIL: one server took 18% more CPU a snapshot
# with four than with two, and fell behind where two kept up (bench/README.md, stop 15).
WRITER_THREADS = {"sqlite": 1, "postgresql": 2}
# Hosts whose pushes came from this server's future within AHEAD_WINDOW_SECONDS past
# which the server suspects its own clock (ERROR log): one host's clock running ahead is
# that host's fault, several at once rarely are.
SUSPECT_SERVER_CLOCK_HOSTS = 3


class Quarantined(Exception):
    """A valid batch the database refused to store: it never will (answered 422)."""


class OverBudget(Exception):
    """The push's time budget was spent before its batch could start (answered 503)."""


@dataclass(frozen=True)
class Stored:
    """A push's answer, and how many of its snapshots were deferred."""

    http: Response
    deferred: int


@dataclass(eq=False)
class Push:
    """One request's batch of snapshots on its way through the writer."""

    raw: bytearray
    credential: PushCredential
    deadline: Deadline
    partial: bool
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Stored]
    body: IngestRequest | None = field(default=None, repr=False)
    # The agent's push interval, from its Gpuwatch-Push-Interval header (None: not sent).
    push_interval: float | None = None
    # Who settled the push first: the writer, starting its writes (claimed), or the
    # request, its budget spent while it waited (abandoned). Never both.
    _claimed: bool = field(default=False, repr=False)
    _abandoned: bool = field(default=False, repr=False)
    _turn: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def claim(self) -> bool:
        """The writer is about to write this push: False when its request already gave
        up on it (answered 503, so nothing may be stored). True again once claimed."""
        with self._turn:
            self._claimed = not self._abandoned
            return self._claimed

    def abandon(self) -> bool:
        """The request's budget is spent: False when the writer already began storing it
        (its answer is on its way), else True and the writer will skip it."""
        with self._turn:
            self._abandoned = not self._claimed
            return self._abandoned

    @property
    def abandoned(self) -> bool:
        with self._turn:
            return self._abandoned


Outcome = tuple[Push, Stored | BaseException]


class Pending:
    """The pushes no writer thread has taken up yet, shared by the threads.

    A thread takes its share of them, not all: a batch stores its pushes one after
    another, so on Postgres (two threads) one thread taking every push waiting while
    the others sat idle would serialise work they could do side by side. Pushes a batch
    had no time for go back to the front, oldest first, where any idle thread takes
    them.

    ``linger`` (seconds, 0 for none): while pushes arrive more often than one per
    ``linger``, a thread that finds fewer than it may take waits for company until the
    oldest push has waited ``linger`` (:data:`LINGER_SECONDS`).
    """

    def __init__(self, *, linger: float = 0.0, clock: Callable[[], float] = time.monotonic) -> None:
        self._pushes: deque[tuple[float, Push]] = deque()  # (arrived, push)
        self._changed = threading.Condition()
        self._idle = 0  # threads waiting in take()
        self._closed = False
        self.linger = linger
        self._clock = clock
        # Seconds between arrivals, smoothed over about the last eight.
        self._gap = float("inf")
        self._last_put = clock()

    def __len__(self) -> int:
        return len(self._pushes)

    def put(self, push: Push) -> None:
        now = self._clock()
        with self._changed:
            gap = now - self._last_put
            self._gap = gap if self._gap == float("inf") else self._gap + (gap - self._gap) / 8
            self._last_put = now
            self._pushes.append((now, push))
            self._changed.notify()

    def put_back(self, pushes: Sequence[Push]) -> None:
        """Return ``pushes`` to the front, in their order (they wait no longer)."""
        if not pushes:
            return
        with self._changed:
            self._pushes.extendleft((float("-inf"), push) for push in reversed(pushes))
            self._changed.notify(len(pushes))

    def take(self, most: int) -> list[Push] | None:
        """Wait for pushes; take up to ``most``, at most this thread's even share with
        the idle ones (perhaps none, when others took them while it lingered). None
        once closed and empty."""
        with self._changed:
            self._idle += 1
            try:
                while not self._pushes:
                    if self._closed:
                        return None
                    self._changed.wait()
                if self.linger > 0 and self._gap < self.linger:
                    self._linger(most)
            finally:
                self._idle -= 1
            share = -(-len(self._pushes) // (self._idle + 1))
            taken = [self._pushes.popleft()[1] for _ in range(min(most, share))]
            if self._pushes and self._idle:
                self._changed.notify()
            return taken

    def _linger(self, most: int) -> None:
        """Wait until ``most`` pushes wait, or the oldest of them has waited ``linger``
        by the injected clock (the condition's timeout only bounds each check), or none
        is left (another thread took them), or the writer closes."""
        while self._pushes and len(self._pushes) < most and not self._closed:
            left = self._pushes[0][0] + self.linger - self._clock()
            if left <= 0:
                return
            self._changed.wait(left)

    def close(self) -> None:
        """Threads take what is left, then stop."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()


class IngestWriter:
    """Stores pushes for :func:`store` callers in its own threads (started on first use).

    ``clock`` (monotonic seconds) times batches and the linger; it is not the
    context's monotonic clock, so a test's injected budget clock is read only where the
    budget is.
    ``threads`` and ``linger_seconds`` default by dialect (:data:`WRITER_THREADS`,
    :data:`LINGER_SECONDS`); ``batch_seconds`` is :data:`BATCH_SECONDS`.
    """

    def __init__(
        self,
        context: ServerContext,
        *,
        threads: int | None = None,
        batch_seconds: float = BATCH_SECONDS,
        linger_seconds: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.context = context
        self.threads = threads or WRITER_THREADS.get(context.database.dialect, 1)
        self.batch_seconds = batch_seconds
        self._clock = clock
        if linger_seconds is None:
            linger_seconds = LINGER_SECONDS.get(context.database.dialect, 0.0)
        self._pending = Pending(linger=linger_seconds, clock=clock)
        self._started: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._closed = False

    @property
    def queued(self) -> int:
        """Pushes waiting for a writer thread to take them up."""
        return len(self._pending)

    async def store(
        self,
        raw: bytearray,
        credential: PushCredential,
        deadline: Deadline,
        partial: bool,
        *,
        push_interval: float | None = None,
    ) -> Stored:
        """Parse and store one push; raises what its answer is when it is not a 200."""
        loop = asyncio.get_running_loop()
        push = Push(
            raw,
            credential,
            deadline,
            partial,
            loop,
            loop.create_future(),
            push_interval=push_interval,
        )
        self._start()
        self._pending.put(push)
        # Answered by its budget whatever the writer is doing (a long batch, a turn held
        # elsewhere, a snapshot being applied), not only when the writer reads it.
        try:
            return await asyncio.wait_for(asyncio.shield(push.future), deadline.wait_left())
        except TimeoutError:
            if not push.abandon():
                return await push.future  # already being written: its answer follows
            push.future.cancel()  # nobody reads the writer's outcome now
            raise OverBudget from None

    def close(self, timeout: float = 30.0) -> None:
        """Store what is queued, then stop the threads."""
        with self._lock:
            self._closed = True
            started = list(self._started)
        self._pending.close()
        for thread in started:
            thread.join(timeout)

    def _start(self) -> None:
        if self._started:
            return
        with self._lock:
            if self._started or self._closed:
                return
            for n in range(self.threads):
                thread = threading.Thread(target=self._run, name=f"ingest-writer-{n}", daemon=True)
                thread.start()
                self._started.append(thread)

    def _run(self) -> None:
        while (batch := self._pending.take(BATCH_PUSHES)) is not None:
            if not batch:
                continue
            try:
                outcomes, carried = self._run_batch(batch)
            except BaseException as err:  # a bug here must not leave requests waiting
                log.error("ingest writer: batch failed", exc_info=err)
                outcomes, carried = [(push, err) for push in batch], []
            self._pending.put_back(carried)
            _settle(outcomes)

    def _run_batch(self, batch: Sequence[Push]) -> tuple[list[Outcome], list[Push]]:
        """Store what of ``batch`` fits in one transaction's time; return the outcomes
        and the pushes left for the next batch."""
        outcomes: list[Outcome] = []
        ready: list[Push] = []
        for push in batch:
            if push.body is not None:  # parsed already: carried over from a batch before
                ready.append(push)
                continue
            try:
                self._parse(push)
            except Exception as err:
                outcomes.append((push, err))
            else:
                ready.append(push)
        # Refused before any work: answered now, not after the batch's work.
        _settle(outcomes)
        if not ready:
            return [], []
        return self._store_together(ready)

    def _parse(self, push: Push) -> None:
        context, credential = self.context, push.credential
        # Queued past the budget (or answered already): not even parsed, which would
        # cost as much CPU as storing a small batch.
        if push.deadline.passed() or push.abandoned:
            raise OverBudget
        try:
            push.body = IngestRequest.model_validate_json(push.raw)
        except ValidationError as err:
            reverify_push(context, credential)
            errors = err.errors(include_url=False, include_input=False)
            raise RequestValidationError(errors) from err
        for snapshot in push.body.snapshots:
            forbid_other_host(credential.identity, snapshot.hostname)
        self._bound_work(push, push.body)

    def _bound_work(self, push: Push, body: IngestRequest) -> None:
        """Hold the push to what one push and its host may cost (ingest/work.py):
        trim snapshots past the per-snapshot bound, refuse 413 a push that needs more
        than one push's work and cannot be answered in part, 429 while the host's work
        bucket is in debt. Nothing is stored by then."""
        identity = push.credential.identity
        left_out = 0
        for n, snapshot in enumerate(body.snapshots):
            body.snapshots[n], trimmed = work.bounded(snapshot, work.MAX_PROCESSES_PER_SNAPSHOT)
            left_out += trimmed
        if left_out:
            log.warning(
                "host %s: %d process(es) past %d a snapshot not tracked (each GPU keeps"
                " its largest holders)",
                identity.hostname,
                left_out,
                work.MAX_PROCESSES_PER_SNAPSHOT,
            )
        needed = sum(work.snapshot_work(s) for s in body.snapshots)
        if not push.partial and len(body.snapshots) > 1 and needed > work.MAX_PROCESSES_PER_PUSH:
            raise HTTPException(
                status.HTTP_413_CONTENT_TOO_LARGE,
                detail=f"this batch lists {needed - len(body.snapshots)} processes, more than"
                f" one request may apply ({work.MAX_PROCESSES_PER_PUSH}); send fewer"
                " snapshots per request",
            )
        debt = self.context.ingest_work.debt_seconds(identity.host_id)
        if debt is not None:
            raise HTTPException(
                status.HTTP_429_TOO_MANY_REQUESTS,
                detail="this host has used its share of the server's ingest work; retry"
                " after Retry-After seconds",
                headers={"Retry-After": work.retry_after(debt)},
            )

    def _store_together(self, ready: list[Push]) -> tuple[list[Outcome], list[Push]]:
        outcomes: list[Outcome] = []
        done: list[tuple[Push, service.IngestResult]] = []
        refused: list[Push] = []
        carried: list[Push] = []
        current: Push | None = None
        # The earliest time budget of the pushes done: they wait for this batch's
        # commit, so no push after them may run past it.
        waiting: Deadline | None = None
        began = self._clock()
        try:
            database = self.context.database
            hosts = {push.credential.identity.host_id for push in ready}
            # Never waits for a pooled connection past the earliest budget (reads have
            # slots of their own, database/core.py), even where no lock timeout is set.
            budget_left = min(push.deadline.left() for push in ready)
            with database.writer(
                wait_seconds=self._wait_limit(budget_left), slot_seconds=budget_left
            ) as session:
                if database.dialect == "postgresql" and len(hosts) > 1:
                    # Tokens before hosts, as every writer takes them (deps.py).
                    lock_push_tokens(session, (push.credential for push in ready))
                    lock_hosts(session, hosts)
                for n, push in enumerate(ready):
                    if n and (
                        self._clock() - began > self.batch_seconds
                        or (waiting is not None and waiting.passed())
                    ):
                        carried = ready[n:]
                        break
                    current = push
                    try:
                        result = self._store_one(session, push, waiting)
                    except (HTTPException, RequestValidationError, OverBudget) as err:
                        _settle([(push, err)])  # refused before writing anything: now
                        refused.append(push)
                        current = None
                        continue
                    current = None
                    done.append((push, result))
                    waiting = _earlier(push.deadline, waiting)
                session.commit()
        except Exception as err:
            written = [push for push, _ in done] + ([current] if current is not None else [])
            untouched = [p for p in ready if p not in carried and p not in refused]
            if not written and is_wait_timeout(err):
                # The turn or a lock did not come within the earliest budget: the pushes
                # out of budget are answered, the rest wait for the next batch.
                spent = [p for p in untouched if p.deadline.passed()]
                if spent:
                    rest = [p for p in untouched if p not in spent]
                    return [(push, OverBudget()) for push in spent], rest + carried
            if is_unavailable(err) or not written:
                # Every push of the transaction meets what a retry of it would meet.
                return [(push, self._failure(push, err)) for push in untouched], carried
            # Those not started when it failed wait for the next batch.
            started = {id(push) for push in written + refused}
            carried = carried or [p for p in ready if id(p) not in started]
            if len(written) == 1:
                return [(written[0], self._failure(written[0], err))], carried
            log.warning(
                "ingest: a batch of %d pushes failed (%s); storing each alone",
                len(written),
                describe(err),
            )
            for push in written:
                alone, left = self._store_together([push])
                outcomes += alone
                carried += left
            return outcomes, carried
        return [(push, self._answer(push, result)) for push, result in done], carried

    def _wait_limit(self, wait: float) -> float | None:
        """How long the batch may wait for its write turn (SQLite) or its hosts' locks
        (Postgres): until the earliest budget among its pushes runs out (``wait``, the
        seconds it has left).

        On Postgres the limit costs a statement per batch (``lock_timeout``), about 6%
        of a single-snapshot push's CPU (bench/writer.py), so it is set only once the
        oldest push has queued :data:`QUEUED_SECONDS`. A push that has not queued has
        its whole budget left, and the agent waits twice that; only another batch or a
        job holds a host's lock, each for at most a budget.
        """
        if self.context.database.dialect != "postgresql":
            return wait
        budget = self.context.settings.ingest_time_budget_seconds
        return wait if wait < budget - QUEUED_SECONDS else None

    def _store_one(
        self, session: Session, push: Push, waiting: Deadline | None
    ) -> service.IngestResult:
        """Store one push in ``session``; ``waiting`` is the earliest budget of the
        pushes before it in the batch, which a partial answer must not run past."""
        context, credential, body = self.context, push.credential, push.body
        assert body is not None
        confirm_push(session, context, credential)
        # Checked once the write transaction has begun (BEGIN IMMEDIATE on SQLite
        # waits there for writers in other processes): all the queueing is behind us.
        # From here the request waits for this push's answer, whatever its budget.
        if push.deadline.passed() or not push.claim():
            raise OverBudget
        try:
            return service.ingest_snapshots(
                session=session,
                dialect=context.database.dialect,
                host_id=credential.identity.host_id,
                request=body,
                settings=context.settings,
                now=context.clock(),
                cache=context.host_states,
                out_of_time=_earlier(push.deadline, waiting).passed if push.partial else None,
                push_interval=push.push_interval,
                work=work.PushWork(
                    context.ingest_work, credential.identity.host_id, partial=push.partial
                ),
            )
        except service.SnapshotRejected as err:
            self._ahead_of_clock(push, context.clock())
            raise refusal(CLOCK_SKEW_PROBLEM, ("body", "snapshots", err.index), str(err)) from err

    def _ahead_of_clock(self, push: Push, now: float) -> None:
        """Count a push refused as from the future; when many hosts' pushes are, say
        that this server's clock is the likelier culprit (one ERROR per window)."""
        stats = self.context.stats
        hosts = stats.note_ahead(push.credential.identity.host_id, now)
        if hosts >= SUSPECT_SERVER_CLOCK_HOSTS and stats.suspect_server_clock(now):
            log.error(
                "%d hosts pushed snapshots more than %.0f s ahead of this server's clock in"
                " the last %.0f s: this server's clock is probably behind (a restored VM,"
                " broken NTP; check timedatectl). Their agents keep the snapshots spooled"
                " and retry",
                hosts,
                service.MAX_FUTURE_SKEW_SECONDS,
                AHEAD_WINDOW_SECONDS,
            )
        else:
            log.warning(
                "host %s: snapshots more than %.0f s ahead of this server's clock refused"
                " (clock_skew): that host's clock runs ahead, or this server's behind",
                push.credential.identity.hostname,
                service.MAX_FUTURE_SKEW_SECONDS,
            )

    def _failure(self, push: Push, err: BaseException) -> BaseException:
        """What a push stored alone (or in a transaction the database lost) answers for
        ``err``: quarantined when its data can never be stored, else ``err`` itself."""
        if not isinstance(err, STORE_ERRORS) or not never_storable(err):
            return err
        identity, body = push.credential.identity, push.body
        log.error(
            "host %s: quarantined a batch of %d snapshot(s) the database refused: %s",
            identity.hostname,
            len(body.snapshots) if body is not None else 0,
            describe(err),
            exc_info=err,
        )
        quarantined = Quarantined(f"the database cannot store this batch: {describe(err)}")
        quarantined.__cause__ = err
        return quarantined

    def _answer(self, push: Push, result: service.IngestResult) -> Stored:
        """Once committed: keep the host's state, count, and build the 200."""
        context, identity = self.context, push.credential.identity
        if result.kept is not None:
            context.host_states.put(identity.host_id, result.kept)
        stats = context.stats
        # "accepted" counts what this push stored: applied, or late (stored, not applied).
        stats.count(stats.ingest_snapshots, "accepted", result.accepted)
        stats.count(stats.ingest_snapshots, "duplicate", result.duplicate)
        stats.count(stats.ingest_snapshots, "deferred", result.deferred)
        stats.count(stats.clock_stepped, None, result.clock_stepped)
        body = push.body
        if body is not None and stats.note_agent(identity.host_id, body.snapshots[-1].agent_id):
            flaps = stats.agent_flaps_of(identity.host_id)
            if flaps == 1 or flaps % 100 == 0:  # one line per streak, not per push
                log.warning(
                    "host %s: pushes alternate between two agent_ids (%d switches back so"
                    " far): two agents report this host name (a cloned VM, a copied config"
                    " or token?); give each machine its own hostname and token",
                    identity.hostname,
                    flaps,
                )
        for kind, n in result.opened.items():
            stats.count(stats.events_opened, kind, n)
        if result.deferred:
            log.debug(
                "host %s: time budget spent, %d of %d snapshot(s) deferred",
                identity.hostname,
                result.deferred,
                len(result.results),
            )
        reply = IngestResponse(
            accepted=result.accepted, duplicate=result.duplicate, results=result.results
        )
        http = Response(reply.model_dump_json(), media_type="application/json")
        return Stored(http=http, deferred=result.deferred)


def _earlier(deadline: Deadline, other: Deadline | None) -> Deadline:
    return deadline if other is None or deadline.at <= other.at else other


def _settle(outcomes: Sequence[Outcome]) -> None:
    """Hand each push its outcome, with one wake-up per event loop."""
    by_loop: dict[asyncio.AbstractEventLoop, list[Outcome]] = {}
    for outcome in outcomes:
        by_loop.setdefault(outcome[0].loop, []).append(outcome)
    for loop, settled in by_loop.items():
        # A closed loop raises RuntimeError: nobody is waiting any more.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(_resolve, settled)


def _resolve(outcomes: Sequence[Outcome]) -> None:
    for push, outcome in outcomes:
        if push.future.done():  # cancelled: the client went away
            continue
        if isinstance(outcome, BaseException):
            push.future.set_exception(outcome)
        else:
            push.future.set_result(outcome)
