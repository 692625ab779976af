"""Push snapshots to the central server, through the on-disk spool.

The promise, "nothing lost": every snapshot offered to :meth:`Reporter.offer` ends in
exactly one of two states. Either the server acknowledged it (``pushed_total`` counts
it once, as ``accepted`` or, when an earlier try had already reached the server, as
``duplicate``), or it is counted in ``dropped_total`` under its reason:

* ``spool_full``: the spool passed ``spool_max_bytes`` while the server was away and
  its oldest snapshots were evicted;
* ``corrupt``: a spooled record could not be read back (a crash mid-write, a damaged
  disk);
* ``rejected``: the server answered 422 for that one snapshot (a poison record), or
  refused it as collected too far in the future when this agent's own clock agrees
  that it was (the clock was ahead when it was taken, and has been set right since);
* ``too_large``: the server answered 413 for that one snapshot alone;
* ``write_failed``: the spool could not write it (a read-only filesystem, a disk full
  of other files) and the in-memory queue that stands in for it
  (:data:`MEMORY_QUEUE_SNAPSHOTS`, sent like the spool while the server is up) was full;
* ``hostname_changed``: it was spooled under a hostname the agent no longer reports (the
  host was renamed, or ``hostname`` changed in the config), so no token of this host
  can deliver it (below).

Until then it is ``pending``, and that includes a snapshot the server answered
``deferred`` (below): it stays spooled and is sent again.

When the spool refuses a write (after it has tried to make room and to recreate a
removed directory, gpuwatch/agent/spool.py) the snapshot is kept in memory and sent
after what the spool holds, so a bad disk does not silence a host whose server is up;
the agent logs one ERROR, and :meth:`Reporter.spool_problem` says so (the agent's
``/healthz``). Snapshots in memory are lost if the agent stops. Once the spool writes
again, what waits in memory is moved into it first, so the order is kept.

Clock skew: the server refuses a snapshot collected more than
:data:`~gpuwatch.wire.MAX_FUTURE_SKEW_SECONDS` ahead of *its* clock (422, problem type
``clock_skew``). It cannot tell this host's clock running ahead from its own running
behind (a VM restored from a snapshot, broken NTP). The agent can: when the refused
snapshot is not that far ahead of the agent's clock now, either the server's clock is
behind or this host's still runs ahead, and neither is the snapshot's fault, so the
batch stays spooled and is retried after a backoff (``clock_skew`` in
``batches_total``, one ERROR naming both clocks and how far apart they are); the
spool's own bound (``spool_full``) is what limits how long. Only a snapshot that this
agent's clock too puts that far in the future (stamped while the clock was ahead) is
dropped as ``rejected``. A server whose clock is behind therefore delays delivery
rather than destroying the fleet's data. Delivery is at least once;
the server stores each ``(agent_id, boot_id, sequence)`` once, so a retry after a lost
response is harmless.

Protocol: ``POST {server_url}/api/v1/snapshots`` with ``Authorization: Bearer <token>``
and an :class:`~gpuwatch.wire.IngestRequest`, ``{"snapshots": [HostSnapshot, ...],
"spool_dropped_total": d}`` (1..500 snapshots; ``d`` is how many this agent has dropped,
all reasons, added up over its runs on this spool directory (Spool.dropped_ever: it
starts again from 0 only when the spool directory is cleared), which the server keeps
per host for its spool-drop metric), and
``Gpuwatch-Partial: deferred`` (:data:`~gpuwatch.wire.PARTIAL_HEADER`): this agent
understands partial answers. 2xx acknowledges the batch with an
:class:`~gpuwatch.wire.IngestResponse` (``{"accepted": n, "duplicate": m, "results":
[...]}``), item by item: the items answered ``deferred`` (the server's time budget for
the request ran out before it got to them) are not acknowledged but kept, and sent
again, oldest first, after a short pause (:data:`DEFERRED_PAUSE_SECONDS`); such a
request counts as ``partial``, not as a failure. Only a well-formed ingest answer (a
JSON object with integer ``accepted`` and ``duplicate``) settles anything: a 2xx with
any other body (a proxy's HTML page, a captive portal, another service's JSON) is not
the server speaking, so the batch stays spooled and is retried like a failure
(``unexpected_status``), with one warning in the log. 413 and 422 split the batch in
halves until the offending snapshot stands alone, which is then dropped and counted
(but see "Clock skew" above for a 422 ``clock_skew``). A 413 halves the batch byte
limit; after :data:`GROW_AFTER_BATCHES` batches stored in a row it doubles again, up to
:data:`MAX_BATCH_BYTES`, so a limit the server (or a proxy) had for a while does not
hold for the agent's life.
401/403 keep everything spooled and raise the ``auth_failed`` flag; the log quotes the
server's ``detail``. Anything else (429, 5xx,
other statuses, connection errors) is retried after exponential backoff with jitter,
and never before the server's ``Retry-After``: up to half as long again after it
(:data:`RETRY_AFTER_SPREAD`), since the agents one busy server refused together would
otherwise all come back in the same second. The token is never logged, and whatever
the server says (status line, headers, ``detail``) is escaped before it reaches the log
(:func:`~gpuwatch.terminal_text.printable`): on plain ``http://`` anyone on the path
can answer.

A renamed host: every snapshot names the hostname it was taken under, and the server
refuses a batch holding any snapshot its token's host did not take (403, ``detail``
:data:`OTHER_HOST_DETAIL` and the token's host). Snapshots spooled under a name this
agent no longer reports could therefore never be delivered, and the oldest-first drain
would stay stuck behind them. So once the agent has offered a snapshot (whose hostname
is then the current one), spooled snapshots of any other hostname are dropped before
they are sent, counted as ``hostname_changed``, with one warning naming both names;
snapshots of the current hostname are never dropped for it. Until the first offer the
push thread waits (at most one push interval) rather than send what it cannot judge.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gpuwatch.agent import push_answers as answers
from gpuwatch.agent.collectors.agent import PushStats
from gpuwatch.agent.http_post import Endpoint, Poster, Reply, Unreachable
from gpuwatch.agent.spool import MemoryQueue, Spool, SpooledSnapshot, encode
from gpuwatch.bearer import bearer_headers
from gpuwatch.settings import AgentSettings
from gpuwatch.snapshot import HostSnapshot
from gpuwatch.wire import (
    MAX_FUTURE_SKEW_SECONDS,
    MAX_SNAPSHOTS_PER_REQUEST,
    PARTIAL_DEFERRED,
    PARTIAL_HEADER,
    PUSH_INTERVAL_HEADER,
    SNAPSHOTS_PATH,
    ingest_request_json,
)

log = logging.getLogger(__name__)

# Half the server's default max_body_bytes (8 MiB): room for its own overhead. A
# smaller server limit is learnt from its 413s.
MAX_BATCH_BYTES = 4 * 2**20
BACKOFF_BASE_SECONDS = 1.0
# Low enough that a returning server is noticed within a minute.
BACKOFF_MAX_SECONDS = 60.0
# The retry after a Retry-After falls at a random point of [1, 1 + this] times it.
RETRY_AFTER_SPREAD = 0.5
# The server gives itself half of this per request (ingest_time_budget_seconds).
HTTP_TIMEOUT_SECONDS = 10.0
# After a partial answer, the deferred snapshots are sent again after this long, with
# equal jitter (half to all of it). Not at once: the server just spent its whole time
# budget on our request, and resending at once would put the rest straight back in the
# queue that made it late, ahead of the live pushes of other hosts. Not after a
# backoff either: the server answered and stored what it could, so it is busy, not
# failing, and each such request still moves the drain forward; the pause does not grow.
DEFERRED_PAUSE_SECONDS = 2.0
# Batches stored in a row after which a byte limit learnt from a 413 doubles again.
GROW_AFTER_BATCHES = 16
# Snapshots kept in memory while the spool cannot write: a few minutes of pushes, a
# few MiB at most, sent while the server is up.
MEMORY_QUEUE_SNAPSHOTS = 64


@dataclass(frozen=True)
class DrainResult:
    """What one :meth:`Reporter.drain_once` did.

    ``stopped_by`` is ``None`` when the spool was emptied, ``"backoff"`` when the retry
    time had not come yet (nothing sent), ``"deferred"`` when the server deferred part
    of a batch (not a failure: a pause), else the failure that stopped the drain:
    ``"unreachable"``, ``"auth_failed"``, ``"throttled"``, ``"server_error"``,
    ``"clock_skew"`` (the server refused snapshots as from its future, while this
    agent's clock does not put them there) or ``"unexpected_status"`` (a status this agent does not expect, or a 2xx that is not
    an ingest answer). ``retry_in_seconds`` is when the next try may happen.
    ``dropped`` includes snapshots dropped as ``hostname_changed`` before sending.
    """

    delivered: int
    dropped: int
    pending: int
    stopped_by: str | None = None
    retry_in_seconds: float | None = None


@dataclass(frozen=True)
class ReporterStats:
    """Counters the agent exports as metrics.

    ``pushed_total``: snapshots acknowledged, by result (``accepted``, ``duplicate``).
    ``batches_total``: requests, by result (``success``, ``partial``: stored in part,
    the rest deferred, ``auth_failed``, ``too_large``, ``rejected``, ``throttled``,
    ``server_error``, ``unreachable``, ``clock_skew``: refused as from the server's
    future and kept, ``unexpected_status``: another status, or a 2xx whose body is not
    an ingest answer).
    ``dropped_total``: snapshots given up, by reason (see the module docstring).
    ``last_success_time``: Unix epoch seconds of the last acknowledged batch.
    """

    pushed_total: dict[str, int]
    batches_total: dict[str, int]
    dropped_total: dict[str, int]
    pending: int
    oldest_pending_age_seconds: float | None
    last_success_time: float | None
    consecutive_failures: int
    auth_failed: bool


@dataclass(frozen=True)
class _Sent:
    """The outcome of sending one batch (and its halves, if it was split)."""

    delivered: int = 0
    dropped: int = 0
    failure: str | None = None
    retry_after_seconds: float | None = None
    # What the log says of the failure: escaped, from the server's answer.
    detail: str = ""
    # Snapshots the last request's answer deferred: kept spooled, sent after a pause.
    deferred: int = 0
    # For a refusal only the operator can end: what to do, for the log.
    remedy: str = ""

    def then(self, other: _Sent) -> _Sent:
        return _Sent(
            self.delivered + other.delivered,
            self.dropped + other.dropped,
            other.failure,
            other.retry_after_seconds,
            other.detail,
            other.deferred,
            other.remedy,
        )


class Reporter:
    """Spools offered snapshots and pushes them to ``settings.server_url``.

    ``clock`` is monotonic seconds, for backoff; ``wall_clock`` is
    Unix epoch seconds, for ``last_success_time``, the spool's enqueue stamps and
    HTTP-date ``Retry-After`` values; ``rand`` returns floats in [0, 1) for jitter.

    Raises :class:`~gpuwatch.errors.ConfigError` when ``server_url`` is missing or not
    an http(s) URL, or the spool directory is unusable.
    """

    def __init__(
        self,
        settings: AgentSettings,
        *,
        clock: Callable[[], float] = time.monotonic,
        rand: Callable[[], float] = random.random,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        endpoint = Endpoint.parse(settings.server_url, SNAPSHOTS_PATH)
        self._url, self._shown_url = endpoint.url, endpoint.shown
        token = settings.token.get_secret_value() if settings.token else None
        self._headers = {
            "Content-Type": "application/json",
            PARTIAL_HEADER: PARTIAL_DEFERRED,
            # The server counts this host's silence in this agent's own interval.
            PUSH_INTERVAL_HEADER: f"{settings.push_interval_seconds:g}",
        }
        # Stripped, and refused at startup (exit 3) if it cannot be a header value.
        self._headers.update(bearer_headers(token))
        self._interval = settings.push_interval_seconds
        self._clock, self._rand, self._wall_clock = clock, rand, wall_clock
        self._spool = Spool(
            settings.spool_dir, max_bytes=settings.spool_max_bytes, clock=wall_clock
        )
        self._memory = MemoryQueue(MEMORY_QUEUE_SNAPSHOTS, self._spool.count_dropped)
        self._client = Poster(timeout_seconds=HTTP_TIMEOUT_SECONDS)
        self._max_batch_bytes = MAX_BATCH_BYTES
        self._stored_in_a_row = 0  # batches stored since the last 413, for the limit
        self._lock = threading.Lock()  # guards the counters below
        self._drain_lock = threading.Lock()  # one drain at a time
        self._pushed: Counter[str] = Counter()
        self._batches: Counter[str] = Counter()
        self._last_success: float | None = None
        self._failures = 0
        self._failing: str | None = None  # the failure last logged, for once-per-change logs
        self._spool_failing: str | None = None  # why the spool refuses writes, if it does
        self._next_attempt_at = float("-inf")
        self._stopping = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        # The hostname the agent reports: that of the latest snapshot offered (None
        # before the first); and the drain's: the name it last compared records with,
        # and the highest record number found to bear it.
        self._hostname: str | None = None
        self._checked_for: str | None = None
        self._checked_up_to = -1

    # --- the poll loop's side -----------------------------------------------------------

    def offer(self, snapshot: HostSnapshot) -> None:
        """Spool ``snapshot`` for the push thread; never waits on the network."""
        # One assignment, read once per batch by the drain: no lock (the drain holds its
        # own for the length of a request, which offer must never wait for).
        self._hostname = snapshot.hostname
        body = encode(snapshot)
        try:
            self._to_spool(body)
        except OSError as err:
            # Sent from memory instead, while the server is up (the module docstring).
            self._memory.put(body)
            if self._spool_failing is None:
                log.error(
                    "cannot spool snapshots (%s): sending them from memory, up to %d"
                    " waiting (older ones are dropped and counted as write_failed; all are"
                    " lost if the agent stops)",
                    err,
                    MEMORY_QUEUE_SNAPSHOTS,
                )
            self._spool_failing = str(err)
        else:
            if self._spool_failing is not None:
                log.info("spooling snapshots works again")
                self._spool_failing = None
        self._wake.set()

    def _to_spool(self, body: bytes) -> None:
        """Spool ``body``, after what waits in memory (so the order is kept); raises
        OSError, with what could not be spooled back in memory, but ``body``."""
        waiting = self._memory.take_idle()
        if waiting is None:  # some are being sent: ours must not overtake them
            raise OSError("snapshots from memory are being sent")
        for n, earlier in enumerate(waiting):
            try:
                self._spool.append_encoded(earlier)
            except OSError:
                self._memory.put_back(waiting[n:])
                raise
        if waiting:
            log.info("moved %d snapshot(s) from memory into the spool", len(waiting))
        self._spool.append_encoded(body)

    def spool_problem(self) -> str | None:
        """Why the spool refuses writes (snapshots are then sent from memory), or None."""
        failing = self._spool_failing
        if failing is None:
            return None
        return (
            f"the spool cannot be written ({failing}); {self._memory.pending_count()}"
            " snapshot(s) wait in memory"
        )

    def stats(self) -> ReporterStats:
        with self._lock:
            return ReporterStats(
                pushed_total=dict(self._pushed),
                batches_total=dict(self._batches),
                dropped_total=self._spool.dropped(),
                pending=self._spool.pending_count() + self._memory.pending_count(),
                oldest_pending_age_seconds=self._spool.oldest_age_seconds(),
                last_success_time=self._last_success,
                consecutive_failures=self._failures,
                auth_failed=self._failing == "auth_failed",
            )

    def push_stats(self) -> PushStats:
        """:meth:`stats` in the shape the agent's metrics collector reads."""
        stats = self.stats()
        return PushStats(
            pushed=stats.pushed_total,
            batches=stats.batches_total,
            dropped=stats.dropped_total,
            pending=stats.pending,
            last_success_time=stats.last_success_time,
        )

    # --- pushing ---------------------------------------------------------------------------

    def drain_once(self) -> DrainResult:
        """Send spooled snapshots, oldest first, until the spool is empty or a send fails."""
        with self._drain_lock:
            wait = self._next_attempt_at - self._clock()
            if wait > 0:
                return DrainResult(0, 0, self._pending(), "backoff", wait)
            renamed: Counter[str] = Counter()  # snapshots dropped, by the name they bore
            try:
                return self._drain(renamed)
            finally:
                if renamed:
                    self._log_renamed(renamed)

    def _pending(self) -> int:
        return self._spool.pending_count() + self._memory.pending_count()

    def _drain(self, renamed: Counter[str]) -> DrainResult:
        total = _Sent()
        # The spool first: what waits in memory was offered after all it holds.
        for store in (self._spool, self._memory):
            while batch := store.peek_batch(MAX_SNAPSHOTS_PER_REQUEST, self._max_batch_bytes):
                if store is self._spool:
                    batch = self._without_other_hostnames(batch, renamed)
                    if not batch:
                        continue
                total = total.then(self._send(batch, store))
                if total.failure is not None:
                    delay = self._record_failure(total)
                    return DrainResult(
                        total.delivered,
                        total.dropped + renamed.total(),
                        self._pending(),
                        total.failure,
                        delay,
                    )
                if total.deferred:
                    delay = DEFERRED_PAUSE_SECONDS * (0.5 + 0.5 * self._rand())
                    self._next_attempt_at = self._clock() + delay
                    return DrainResult(
                        total.delivered,
                        total.dropped + renamed.total(),
                        self._pending(),
                        "deferred",
                        delay,
                    )
        return DrainResult(total.delivered, total.dropped + renamed.total(), self._pending())

    def _without_other_hostnames(
        self, batch: list[SpooledSnapshot], renamed: Counter[str]
    ) -> list[SpooledSnapshot]:
        """``batch`` less its snapshots of another hostname than the current one, which
        are dropped as ``hostname_changed`` and counted in ``renamed`` by that name.

        Nothing is dropped before the first offer (the current name is not known), nor
        a record whose hostname cannot be read (the server judges it). Each record is
        parsed once a run: those up to ``_checked_up_to`` were found current already."""
        current = self._hostname
        if current is None:
            return batch
        if current != self._checked_for:
            self._checked_for, self._checked_up_to = current, -1
        kept: list[SpooledSnapshot] = []
        other: list[SpooledSnapshot] = []
        for record in batch:
            if record.record_id <= self._checked_up_to:
                kept.append(record)
                continue
            hostname = answers.hostname_of(record.body)
            if hostname is None or hostname == current:
                kept.append(record)
            else:
                other.append(record)
                renamed[hostname] += 1
        if other:
            self._spool.drop(other, "hostname_changed")
        if kept:
            self._checked_up_to = max(self._checked_up_to, kept[-1].record_id)
        return kept

    def _log_renamed(self, renamed: Counter[str]) -> None:
        names = ", ".join(f"'{answers.shown(name)}'" for name in sorted(renamed))
        log.warning(
            "dropped %d spooled snapshot(s) of hostname %s (counted as hostname_changed):"
            " this agent now reports hostname '%s', and no token of it may send them",
            renamed.total(),
            names,
            answers.shown(self._checked_for or ""),
        )

    def _send(self, batch: Sequence[SpooledSnapshot], store: Spool | MemoryQueue) -> _Sent:
        # The drop count as of this request: every run's on this spool directory, which
        # the server stores per host (kept across restarts, so the drops of a run that
        # never reached the server are reported by the next; see Spool.dropped_ever).
        # The spool holds each snapshot as JSON already: the body is built from those
        # bytes, not by parsing them back into models.
        body = ingest_request_json([r.body for r in batch], self._spool.dropped_ever())
        try:
            response = self._client.post(self._url, body, self._headers)
        except Unreachable as err:
            store.release(batch)
            return self._count(_Sent(failure="unreachable", detail=str(err)))
        status = response.status
        if 200 <= status < 300:
            results = answers.results(response, len(batch))
            if results is None:
                # Not the server speaking (a proxy's page, another service): it stored
                # nothing we know of, so nothing is settled.
                store.release(batch)
                return self._count(
                    _Sent(failure="unexpected_status", detail=answers.not_ingest_answer(response))
                )
            deferred = self._acknowledge(batch, results, store)
            self._stored_batch()
            if deferred:
                log.debug("server deferred %d of %d snapshot(s)", deferred, len(batch))
                return self._count(
                    _Sent(delivered=len(batch) - deferred, deferred=deferred), "partial"
                )
            return self._count(_Sent(delivered=len(batch)))
        said = answers.server_detail(response)
        detail = f"HTTP {status}" if said is None else f"HTTP {status}: {said}"
        if status == 422 and self._server_clock_behind(batch, response):
            store.release(batch)
            return self._count(_Sent(failure="clock_skew", detail=self._skew_detail(response)))
        if status in (413, 422):
            return self._split_or_drop(batch, status, len(body), store)
        store.release(batch)
        if status in (401, 403):
            remedy = self._remedy(response)
            return self._count(_Sent(failure="auth_failed", detail=detail, remedy=remedy))
        retry_after = answers.retry_after_seconds(
            response.headers.get("Retry-After"), self._wall_clock()
        )
        failure = (
            "throttled"
            if status in (429, 503)
            else "server_error"
            if status >= 500
            else "unexpected_status"
        )
        return self._count(_Sent(failure=failure, retry_after_seconds=retry_after, detail=detail))

    def _remedy(self, response: Reply) -> str:
        """For a 403 saying the token is another host's: what the operator should do.

        Here every snapshot of the batch bears the current hostname (the others were
        dropped before sending), so the token is the wrong one for this name."""
        token_host = answers.token_host(response)
        if token_host is None:
            return ""
        if self._hostname is None:  # nothing offered yet: which name is ours is not known
            return (
                "a spooled snapshot names another host than the token's: give this agent a"
                " token of the hostname it reports (gpuwatch token create HOSTNAME), or set"
                f' hostname = "{token_host}" in the [agent] section of its config'
            )
        ours = answers.shown(self._hostname)
        return (
            f"this agent reports hostname '{ours}': give it a token of '{ours}'"
            f' (gpuwatch token create {ours}), or set hostname = "{token_host}" in the'
            " [agent] section of its config"
        )

    def _split_or_drop(
        self,
        batch: Sequence[SpooledSnapshot],
        status: int,
        size: int,
        store: Spool | MemoryQueue,
    ) -> _Sent:
        """413/422: halve until the snapshot the server refuses stands alone, then drop it."""
        reason = "too_large" if status == 413 else "rejected"
        self._count(_Sent(), reason)
        if status == 413:
            # Remember the server's limit, so later batches are not refused again (for
            # a while: _stored_batch lets it grow back).
            self._max_batch_bytes = max(1, min(self._max_batch_bytes, size // 2))
            self._stored_in_a_row = 0
        if len(batch) == 1:
            store.drop(batch, reason)
            log.warning("server refused a snapshot (HTTP %s); dropped as %s", status, reason)
            return _Sent(dropped=1)
        half = len(batch) // 2
        first = self._send(batch[:half], store)
        if first.failure is not None or first.deferred:
            store.release(batch[half:])
            return first
        return first.then(self._send(batch[half:], store))

    def _stored_batch(self) -> None:
        """A batch was stored: after GROW_AFTER_BATCHES in a row, a byte limit learnt
        from a 413 doubles, up to MAX_BATCH_BYTES (a too small one is learnt again
        from the next 413, at the cost of one split)."""
        if self._max_batch_bytes >= MAX_BATCH_BYTES:
            return
        self._stored_in_a_row += 1
        if self._stored_in_a_row >= GROW_AFTER_BATCHES:
            self._max_batch_bytes = min(MAX_BATCH_BYTES, self._max_batch_bytes * 2)
            self._stored_in_a_row = 0

    def _server_clock_behind(self, batch: Sequence[SpooledSnapshot], response: Reply) -> bool:
        """True when the server refused a snapshot of ``batch`` as from its future
        (``clock_skew``) that this agent's clock does not put in the future: the
        server's clock may be behind (or this host's still ahead), and the snapshot is
        kept (the module docstring, "Clock skew")."""
        now = self._wall_clock()
        for index in answers.clock_skew_indices(response):
            if 0 <= index < len(batch):
                collected_at = answers.collected_at_of(batch[index].body)
                if collected_at is not None and collected_at <= now + MAX_FUTURE_SKEW_SECONDS:
                    return True
        return False

    def _skew_detail(self, response: Reply) -> str:
        """The log's words for a clock_skew refusal this agent does not agree with."""
        said = answers.server_detail(response)
        offset = answers.server_clock_offset(response, self._wall_clock())
        apart = (
            ""
            if offset is None
            else f"; the server's clock reads {-offset:.0f} s behind this host's"
            if offset < 0
            else f"; the server's clock reads {offset:.0f} s ahead of this host's"
        )
        return (
            f"HTTP 422 clock_skew: {said or 'snapshots from the future'}{apart}. Either this"
            " host's clock runs ahead or the server's runs behind (a restored VM, broken"
            " NTP): check both (timedatectl)"
        )

    def _acknowledge(
        self,
        batch: Sequence[SpooledSnapshot],
        results: Sequence[str],
        store: Spool | MemoryQueue,
    ) -> int:
        """Acknowledge what the server stored; keep what it deferred. Returns how many
        it deferred."""
        deferred = [r for r, result in zip(batch, results, strict=True) if result == "deferred"]
        stored = [r for r, result in zip(batch, results, strict=True) if result != "deferred"]
        store.ack(stored)
        # Back to pending, in order: they are the oldest, so the next batch starts there.
        store.release(deferred)
        counts = Counter({"accepted": 0, "duplicate": 0})  # present even at 0, as before
        counts.update(result for result in results if result != "deferred")
        with self._lock:
            for result, n in counts.items():
                self._pushed[result] += n
            self._last_success = self._wall_clock()
            self._failures = 0
        self._next_attempt_at = float("-inf")
        if self._failing is not None:
            log.info("server %s accepts snapshots again", self._shown_url)
            with self._lock:
                self._failing = None
        return len(deferred)

    def _count(self, sent: _Sent, result: str | None = None) -> _Sent:
        """Count one request under ``result`` (default: its failure, or ``success``)."""
        with self._lock:
            self._batches[result or sent.failure or "success"] += 1
        return sent

    def _record_failure(self, sent: _Sent) -> float:
        """Schedule the next try; log only when the kind of failure changes."""
        with self._lock:
            self._failures += 1
            failures = self._failures
        ceiling = min(BACKOFF_MAX_SECONDS, BACKOFF_BASE_SECONDS * 2 ** min(failures - 1, 30))
        # "Equal jitter": half fixed, half random, so agents restarted together spread
        # out yet none retries at once.
        delay = ceiling * (0.5 + 0.5 * self._rand())
        if sent.retry_after_seconds is not None:
            spread = 1.0 + RETRY_AFTER_SPREAD * self._rand()
            delay = max(delay, sent.retry_after_seconds * spread)
        self._next_attempt_at = self._clock() + delay
        if sent.failure != self._failing:
            if sent.remedy:
                log.error(
                    "server %s refused the snapshots (%s): %s; snapshots stay spooled",
                    self._shown_url,
                    sent.detail,
                    sent.remedy,
                )
            elif sent.failure == "clock_skew":
                log.error(
                    "server %s refuses snapshots as collected in its future (%s);"
                    " snapshots stay spooled and are retried (the oldest are evicted past"
                    " spool_max_bytes, counted as spool_full)",
                    self._shown_url,
                    sent.detail,
                )
            elif sent.failure == "auth_failed":
                log.error(
                    "server %s refused the agent token (%s); snapshots stay spooled",
                    self._shown_url,
                    sent.detail,
                )
            else:
                log.warning(
                    "cannot push to %s (%s: %s); snapshots stay spooled, retrying",
                    self._shown_url,
                    sent.failure,
                    sent.detail,
                )
            with self._lock:
                self._failing = sent.failure
        log.debug("next push try in %.1f s (%s failures)", delay, failures)
        return delay

    # --- the push thread ---------------------------------------------------------------------

    def start(self) -> None:
        """Drain in a background thread: after each offer, every push interval, and on retry."""
        if self._thread is not None:
            return
        self._stopping.clear()
        self._thread = threading.Thread(target=self._run, name="gpuwatch-push", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread (it finishes the request in flight); spooled snapshots stay."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        self._stopping.set()
        self._wake.set()
        thread.join(timeout=HTTP_TIMEOUT_SECONDS * 2)

    def close(self) -> None:
        """Stop the thread and release the HTTP connections and the spool's lock."""
        self.stop()
        self._client.close()
        self._spool.close()

    def __enter__(self) -> Reporter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _run(self) -> None:
        if self._hostname is None and self._pending():
            # What an earlier run spooled may bear a name this agent no longer reports:
            # wait for the first offer, which says the current one (_without_other_hostnames).
            self._wake.wait(self._interval)
        while not self._stopping.is_set():
            self._wake.clear()
            wait = self._interval
            try:
                result = self.drain_once()
                if result.retry_in_seconds is not None:
                    wait = result.retry_in_seconds
            except Exception:
                # The push thread must outlive any bug: if it died, snapshots would pile
                # up unseen until the spool evicted them.
                log.exception("unexpected error while pushing to %s", self._shown_url)
            self._wake.wait(wait)
