"""Push snapshots to the central server, through the on-disk spool.

The promise, "nothing lost": every snapshot offered to :meth:`Reporter.offer` ends in
exactly one of two states. Either the server acknowledged it (``pushed_total`` counts
it once, as ``accepted`` or, when an earlier try had already reached the server, as
``duplicate``), or it is counted in ``dropped_total`` under its reason:

* ``spool_full``: the spool passed ``spool_max_bytes`` while the server was away and
  its oldest snapshots were evicted;
* ``corrupt``: a spooled record could not be read back (a crash mid-write, a damaged
  disk);
* ``rejected``: the server answered 422 for that one snapshot (a poison record);
* ``too_large``: the server answered 413 for that one snapshot alone;
* ``write_failed``: the spool could not write it at all (disk full, read-only).

Until then it is ``pending``, and that includes a snapshot the server answered
``deferred`` (below): it stays spooled and is sent again. Delivery is at least once;
the server stores each ``(agent_id, boot_id, sequence)`` once, so a retry after a lost
response is harmless.

Protocol: ``POST {server_url}/api/v1/snapshots`` with ``Authorization: Bearer <token>``
and an :class:`~gpuwatch.wire.IngestRequest`, ``{"snapshots": [HostSnapshot, ...],
"spool_dropped_total": d}`` (1..500 snapshots; ``d`` is how many this agent has dropped
so far, all reasons, which the server keeps per host for its spool-drop metric), and
``Gpuwatch-Partial: deferred`` (:data:`~gpuwatch.wire.PARTIAL_HEADER`): this agent
understands partial answers. 2xx acknowledges the batch with an
:class:`~gpuwatch.wire.IngestResponse` (``{"accepted": n, "duplicate": m, "results":
[...]}``), item by item: the items answered ``deferred`` (the server's time budget for
the request ran out before it got to them) are not acknowledged but kept, and sent
again, oldest first, after a short pause (:data:`DEFERRED_PAUSE_SECONDS`); such a
request counts as ``partial``, not as a failure. 413 and 422 split the batch in halves
until the offending snapshot stands alone, which is then dropped and counted. 401/403
keep everything spooled and raise the ``auth_failed`` flag. Anything else (429, 5xx,
other statuses, connection errors) is retried after exponential backoff with jitter,
and never before the server's ``Retry-After``: up to half as long again after it
(:data:`RETRY_AFTER_SPREAD`), since the agents one busy server refused together would
otherwise all come back in the same second. The token is never logged.
"""

from __future__ import annotations

import email.utils
import logging
import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC

from pydantic import ValidationError

from gpuwatch.agent.collectors.agent import PushStats
from gpuwatch.agent.http_post import Endpoint, Poster, Reply, Unreachable
from gpuwatch.agent.spool import Spool, SpooledSnapshot
from gpuwatch.bearer import bearer_headers
from gpuwatch.settings import AgentSettings
from gpuwatch.snapshot import HostSnapshot
from gpuwatch.wire import (
    MAX_SNAPSHOTS_PER_REQUEST,
    PARTIAL_DEFERRED,
    PARTIAL_HEADER,
    PUSH_INTERVAL_HEADER,
    SNAPSHOTS_PATH,
    IngestResponse,
    ingest_request_json,
)

log = logging.getLogger(__name__)

# Half the server's default max_body_bytes (8 MiB): room for its own overhead. A
# smaller server limit is learnt from its 413s.
MAX_BATCH_BYTES = 4 * 2**20
BACKOFF_BASE_SECONDS = 1.0
# Low enough that a returning server is noticed within a minute.
BACKOFF_MAX_SECONDS = 60.0
# A buggy or hostile Retry-After must not silence the agent for days.
MAX_RETRY_AFTER_SECONDS = 3600.0
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


@dataclass(frozen=True)
class DrainResult:
    """What one :meth:`Reporter.drain_once` did.

    ``stopped_by`` is ``None`` when the spool was emptied, ``"backoff"`` when the retry
    time had not come yet (nothing sent), ``"deferred"`` when the server deferred part
    of a batch (not a failure: a pause), else the failure that stopped the drain:
    ``"unreachable"``, ``"auth_failed"``, ``"throttled"``, ``"server_error"`` or
    ``"unexpected_status"``. ``retry_in_seconds`` is when the next try may happen.
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
    ``server_error``, ``unreachable``, ``unexpected_status``).
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
    detail: str = ""
    # Snapshots the last request's answer deferred: kept spooled, sent after a pause.
    deferred: int = 0

    def then(self, other: _Sent) -> _Sent:
        return _Sent(
            self.delivered + other.delivered,
            self.dropped + other.dropped,
            other.failure,
            other.retry_after_seconds,
            other.detail,
            other.deferred,
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
        self._client = Poster(timeout_seconds=HTTP_TIMEOUT_SECONDS)
        self._max_batch_bytes = MAX_BATCH_BYTES
        self._lock = threading.Lock()  # guards the counters below
        self._drain_lock = threading.Lock()  # one drain at a time
        self._pushed: Counter[str] = Counter()
        self._batches: Counter[str] = Counter()
        self._write_failures = 0
        self._last_success: float | None = None
        self._failures = 0
        self._failing: str | None = None  # the failure last logged, for once-per-change logs
        self._spool_failing = False
        self._next_attempt_at = float("-inf")
        self._stopping = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    # --- the poll loop's side -----------------------------------------------------------

    def offer(self, snapshot: HostSnapshot) -> None:
        """Spool ``snapshot`` for the push thread; never waits on the network."""
        try:
            self._spool.append(snapshot)
        except OSError as err:
            with self._lock:
                self._write_failures += 1
            if not self._spool_failing:
                log.error("cannot spool snapshots (they are dropped and counted): %s", err)
                self._spool_failing = True
            return
        if self._spool_failing:
            log.info("spooling snapshots works again")
            self._spool_failing = False
        self._wake.set()

    def stats(self) -> ReporterStats:
        with self._lock:
            dropped = Counter(self._spool.dropped())
            if self._write_failures:
                dropped["write_failed"] += self._write_failures
            return ReporterStats(
                pushed_total=dict(self._pushed),
                batches_total=dict(self._batches),
                dropped_total=dict(dropped),
                pending=self._spool.pending_count(),
                oldest_pending_age_seconds=self._spool.oldest_age_seconds(),
                last_success_time=self._last_success,
                consecutive_failures=self._failures,
                auth_failed=self._failing == "auth_failed",
            )

    def _dropped_total(self) -> int:
        """Snapshots dropped so far, all reasons (the sum of ``dropped_total``)."""
        with self._lock:
            return sum(self._spool.dropped().values()) + self._write_failures

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
                return DrainResult(0, 0, self._spool.pending_count(), "backoff", wait)
            total = _Sent()
            while batch := self._spool.peek_batch(MAX_SNAPSHOTS_PER_REQUEST, self._max_batch_bytes):
                total = total.then(self._send(batch))
                if total.failure is not None:
                    delay = self._record_failure(total)
                    pending = self._spool.pending_count()
                    return DrainResult(
                        total.delivered, total.dropped, pending, total.failure, delay
                    )
                if total.deferred:
                    delay = DEFERRED_PAUSE_SECONDS * (0.5 + 0.5 * self._rand())
                    self._next_attempt_at = self._clock() + delay
                    pending = self._spool.pending_count()
                    return DrainResult(total.delivered, total.dropped, pending, "deferred", delay)
            return DrainResult(total.delivered, total.dropped, self._spool.pending_count())

    def _send(self, batch: Sequence[SpooledSnapshot]) -> _Sent:
        # The drop count as of this request: a counter since the agent started, which
        # the server stores per host (a restart resets it, as Prometheus counters do).
        # The spool holds each snapshot as JSON already: the body is built from those
        # bytes, not by parsing them back into models.
        body = ingest_request_json([r.body for r in batch], self._dropped_total())
        try:
            response = self._client.post(self._url, body, self._headers)
        except Unreachable as err:
            self._spool.release(batch)
            return self._count(_Sent(failure="unreachable", detail=str(err)))
        status = response.status
        if 200 <= status < 300:
            deferred = self._acknowledge(batch, response)
            if deferred:
                log.debug("server deferred %d of %d snapshot(s)", deferred, len(batch))
                return self._count(
                    _Sent(delivered=len(batch) - deferred, deferred=deferred), "partial"
                )
            return self._count(_Sent(delivered=len(batch)))
        if status in (413, 422):
            return self._split_or_drop(batch, status, len(body))
        self._spool.release(batch)
        if status in (401, 403):
            return self._count(_Sent(failure="auth_failed", detail=f"HTTP {status}"))
        retry_after = _retry_after_seconds(response.headers.get("Retry-After"), self._wall_clock())
        failure = (
            "throttled"
            if status in (429, 503)
            else "server_error"
            if status >= 500
            else "unexpected_status"
        )
        return self._count(
            _Sent(failure=failure, retry_after_seconds=retry_after, detail=f"HTTP {status}")
        )

    def _split_or_drop(self, batch: Sequence[SpooledSnapshot], status: int, size: int) -> _Sent:
        """413/422: halve until the snapshot the server refuses stands alone, then drop it."""
        reason = "too_large" if status == 413 else "rejected"
        self._count(_Sent(), reason)
        if status == 413:
            # Remember the server's limit, so later batches are not refused again.
            self._max_batch_bytes = max(1, min(self._max_batch_bytes, size // 2))
        if len(batch) == 1:
            self._spool.drop(batch, reason)
            log.warning("server refused a snapshot (HTTP %s); dropped as %s", status, reason)
            return _Sent(dropped=1)
        half = len(batch) // 2
        first = self._send(batch[:half])
        if first.failure is not None or first.deferred:
            self._spool.release(batch[half:])
            return first
        return first.then(self._send(batch[half:]))

    def _acknowledge(self, batch: Sequence[SpooledSnapshot], response: Reply) -> int:
        """Acknowledge what the server stored; keep what it deferred. Returns how many
        it deferred."""
        results = _results(response, len(batch))
        deferred = [r for r, result in zip(batch, results, strict=True) if result == "deferred"]
        stored = [r for r, result in zip(batch, results, strict=True) if result != "deferred"]
        self._spool.ack(stored)
        # Back to pending, in order: they are the oldest, so the next batch starts there.
        self._spool.release(deferred)
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
            if sent.failure == "auth_failed":
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
        """Stop the thread and release the HTTP connections."""
        self.stop()
        self._client.close()

    def __enter__(self) -> Reporter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _run(self) -> None:
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


def _results(response: Reply, sent: int) -> list[str]:
    """What the server answered for each snapshot of the batch: ``accepted``, ``late`` or
    ``duplicate`` (each delivered), or ``deferred`` (not stored). All ``accepted`` when
    the answer is not an :class:`~gpuwatch.wire.IngestResponse` or does not cover the
    batch item by item: a 2xx stored the batch (the server answers ``deferred`` only to
    a request carrying ``Gpuwatch-Partial``, which this agent always sends)."""
    try:
        results: list[str] = list(IngestResponse.model_validate_json(response.content).results)
    except ValidationError:
        results = []
    if len(results) != sent:
        return ["accepted"] * sent
    return results


def _retry_after_seconds(value: str | None, now_epoch: float) -> float | None:
    """``Retry-After`` as seconds from now: delta-seconds or an HTTP date (RFC 9110 §10.2.3)."""
    if value is None:
        return None
    value = value.strip()
    if value.isdigit():
        seconds = float(value)
    else:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
        if when.tzinfo is None:  # "-0000": a UTC time with no zone information
            when = when.replace(tzinfo=UTC)
        seconds = when.timestamp() - now_epoch
    return min(max(seconds, 0.0), MAX_RETRY_AFTER_SECONDS)
