"""Agent request bodies, read only after the token is checked and only within bounds.

Two bounds, because a body costs memory twice: once as bytes while it is read, and
again, many times over, as the objects it parses into.

* Per request: at most ``limit`` bytes (413 past it, before reading when
  ``Content-Length`` says so, as soon as a chunked body passes it otherwise).
* Across requests: a :class:`BodyBudget` of bytes that bodies being read and parsed
  may take at once, of which one host's requests hold at most :data:`HOST_REQUESTS`
  reservations (429 with ``Retry-After`` past that, before reading). A request
  reserves twice what it has read while it reads (a growing buffer copies itself),
  then what its parse is estimated to allocate (:func:`parse_estimate`), and keeps
  that until its answer is built. A request that finds no room is answered 503 with
  ``Retry-After``; one whose estimate alone exceeds the whole budget can never be
  parsed here and is answered 413, so the agent splits it.

Without the budget, 100 concurrent 8 MiB pushes took a server to 2 GiB: each body was
read whole, and a parse costs 6x the body for realistic snapshots and up to 133x for
bodies of minimal objects (``{"pid":1}`` is 9 bytes and a 1.3 KiB process model).

A third bound is time: a :class:`Deadline` per request (``ingest_time_budget_seconds``
from the handler's start). A body still arriving when it passes is not waited for: the
request is answered 503 with ``Retry-After`` and its connection closed. One spent before
its batch starts is answered 503 with ``Retry-After`` (:func:`over_budget`), like a full
memory budget.

Why per host and in time: a reservation is taken as a body starts to arrive, so a
request that announces 8 MiB and sends nothing held 16 MiB for as long as its client
kept the connection open. One host's token, with eight such connections, filled the
whole budget, and every other host's push was answered 503 until they closed.

A body that is valid but that the database refuses to store is *quarantined*
(:func:`never_storable`): answered 422 in the shape of every other 422
(:func:`refusal`), which the agent drops rather than retries forever.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType

from fastapi import HTTPException, Request, status
from fastapi.exceptions import RequestValidationError
from sqlalchemy.exc import DataError, IntegrityError, SQLAlchemyError, StatementError

from gpuwatch.server.database.core import is_unavailable
from gpuwatch.wire import is_json_media_type

# Seconds a 503 asks the agent to wait: memory frees as soon as parses finish.
BUSY_RETRY_AFTER_SECONDS = 1
# Requests of one host that may hold a reservation at once, in this process: an agent
# sends one push at a time and, now and then, one event beside it.
HOST_REQUESTS = 2
# Python objects per JSON object: a GpuProcess with its ProcessOwner is ~1.3 KiB, a Gpu
# ~1.6 KiB (with its health and GPM profiling fields), a HostSnapshot ~1.35 KiB, however
# few of their fields the JSON sets. tests/server/test_hostile.py says when to raise it.
PER_OBJECT_BYTES = 1800
PER_ARRAY_BYTES = 64
# Per byte of body: values parsed into str, int and float objects. Snapshots set each
# value under a key (6x at most, measured); free-form JSON can be arrays of short
# strings (12x).
SNAPSHOT_BYTE_FACTOR = 8
FREE_JSON_BYTE_FACTOR = 12


def parse_estimate(raw: bytes | bytearray, *, byte_factor: int) -> int:
    """An upper bound on the bytes parsing ``raw`` allocates.

    Every JSON object and array starts with ``{`` or ``[``, so counting those bytes
    (strings included, which only overcounts) bounds the objects the parse creates.
    ``count`` runs at memory speed: about 1 ms for 8 MiB.
    """
    return (
        byte_factor * len(raw)
        + PER_OBJECT_BYTES * raw.count(b"{")
        + PER_ARRAY_BYTES * raw.count(b"[")
    )


class BodyBudget:
    """Bytes that request bodies being read and parsed may hold at once, server-wide,
    and the reservations each host holds.

    Thread-safe; a :class:`Reservation` takes from it and gives back.
    """

    def __init__(self, capacity: int, *, host_requests: int = HOST_REQUESTS) -> None:
        if capacity < 1 or host_requests < 1:
            raise ValueError("capacity and host_requests must be positive")
        self.capacity = capacity
        self.host_requests = host_requests
        self._used = 0
        self._by_host: dict[int, int] = {}
        self._lock = threading.Lock()

    @property
    def in_use(self) -> int:
        with self._lock:
            return self._used

    def _take(self, n: int) -> bool:
        with self._lock:
            if self._used + n > self.capacity:
                return False
            self._used += n
            return True

    def _give(self, n: int) -> None:
        with self._lock:
            self._used -= n

    def reserve(self, host_id: int) -> Reservation:
        """A reservation for one of ``host_id``'s requests: 429 with ``Retry-After``
        when the host already holds :attr:`host_requests` of them."""
        with self._lock:
            held = self._by_host.get(host_id, 0)
            if held >= self.host_requests:
                raise HTTPException(
                    status.HTTP_429_TOO_MANY_REQUESTS,
                    detail=f"this host already has {held} requests being read; wait for"
                    " their answers",
                    headers={"Retry-After": str(BUSY_RETRY_AFTER_SECONDS)},
                )
            self._by_host[host_id] = held + 1
        return Reservation(self, host_id)

    def _forget(self, host_id: int) -> None:
        with self._lock:
            held = self._by_host.pop(host_id) - 1
            if held:
                self._by_host[host_id] = held


class Reservation:
    """One request's share of a :class:`BodyBudget`; a context manager that gives it
    all back, and the host's place, on exit."""

    def __init__(self, budget: BodyBudget, host_id: int) -> None:
        self._budget = budget
        self._host_id: int | None = host_id
        self.held = 0

    def grow_to(self, n: int) -> None:
        """Hold at least ``n`` bytes: 413 when ``n`` exceeds the whole budget, 503 with
        ``Retry-After`` when other requests hold the room."""
        if n <= self.held:
            return
        if n > self._budget.capacity:
            raise HTTPException(
                status.HTTP_413_CONTENT_TOO_LARGE,
                detail="this body would take more memory to parse than the server allows;"
                " send fewer snapshots per request",
            )
        if not self._budget._take(n - self.held):
            raise HTTPException(
                status.HTTP_503_SERVICE_UNAVAILABLE,
                detail="the server is parsing as much as it may at once; retry",
                headers={"Retry-After": str(BUSY_RETRY_AFTER_SECONDS)},
            )
        self.held = n

    def release(self) -> None:
        held, self.held = self.held, 0
        if held:
            self._budget._give(held)

    def __enter__(self) -> Reservation:
        return self

    def __exit__(
        self,
        _type: type[BaseException] | None,
        _value: BaseException | None,
        _traceback: TracebackType | None,
    ) -> None:
        self.release()
        if self._host_id is not None:
            self._budget._forget(self._host_id)
            self._host_id = None


@dataclass(frozen=True)
class Deadline:
    """When a request's time budget runs out, on ``clock`` (monotonic seconds).

    ``answer_by`` is the same moment on the event loop's clock (``time.monotonic``),
    where the request waits for its answer (ingest/writer.py): a test's injected
    ``clock`` moves the budget for the server's checks without moving the wait.
    """

    at: float
    clock: Callable[[], float]
    answer_by: float = math.inf

    @classmethod
    def after(cls, seconds: float, *, clock: Callable[[], float]) -> Deadline:
        return cls(at=clock() + seconds, clock=clock, answer_by=time.monotonic() + seconds)

    def wait_left(self) -> float:
        """Seconds the request may still wait for its answer, on the loop's clock."""
        return max(0.0, self.answer_by - time.monotonic())

    def passed(self) -> bool:
        return self.clock() >= self.at

    def left(self) -> float:
        """Seconds until it passes (negative once it has)."""
        return self.at - self.clock()


def over_budget(budget_seconds: float) -> HTTPException:
    """The 503 for a request that spent its time budget waiting (nothing stored).

    ``Retry-After`` is the budget: a queue that held this request that long takes
    about as long to drain, and a retry sooner would join the same queue.
    """
    return HTTPException(
        status.HTTP_503_SERVICE_UNAVAILABLE,
        detail="the server is too busy to store this batch in time; retry",
        headers={"Retry-After": str(max(1, math.ceil(budget_seconds)))},
    )


def require_json(request: Request) -> None:
    """415 unless the body is declared ``application/json``."""
    if not is_json_media_type(request.headers.get("content-type")):
        raise HTTPException(status.HTTP_415_UNSUPPORTED_MEDIA_TYPE, detail="send application/json")


def _too_large(limit: int) -> HTTPException:
    return HTTPException(
        status.HTTP_413_CONTENT_TOO_LARGE, detail=f"body larger than {limit} bytes"
    )


async def read_body(
    request: Request, *, limit: int, reservation: Reservation, deadline: Deadline
) -> bytearray:
    """The request's body, at most ``limit`` bytes, held within ``reservation``, all of
    it arrived before ``deadline``.

    Call it only once the token has been checked: nothing of the body is read before.
    Raises 413 past ``limit``, 503 when the budget has no room and 503 with
    ``Connection: close`` when the body is still arriving at ``deadline`` (see the
    module docstring); what was read by then is dropped.
    """
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit():
        if int(declared) > limit:
            raise _too_large(limit)
        reservation.grow_to(2 * int(declared))
    body = bytearray()
    try:
        # The event loop's clock, for as long as the budget has left on the request's.
        async with asyncio.timeout(max(0.0, deadline.left())):
            async for chunk in request.stream():
                body += chunk
                if len(body) > limit:
                    raise _too_large(limit)
                reservation.grow_to(2 * len(body))
    except TimeoutError:
        raise SlowBody(len(body)) from None
    return body


class SlowBody(HTTPException):
    """503: the body was still arriving when the request's time budget ran out."""

    def __init__(self, received: int) -> None:
        super().__init__(
            status.HTTP_503_SERVICE_UNAVAILABLE,
            detail="the body did not arrive within the request's time budget"
            f" ({received} bytes had); retry",
            # What is still on its way would be read as the next request.
            headers={"Retry-After": str(BUSY_RETRY_AFTER_SECONDS), "Connection": "close"},
        )


def refusal(kind: str, loc: tuple[str | int, ...], msg: str) -> RequestValidationError:
    """A 422 in the shape of every other (``HTTPValidationError`` in the OpenAPI)."""
    return RequestValidationError([{"type": kind, "loc": loc, "msg": msg}])


# What storing raises for data it can never store. SQLite's driver raises a bare
# OverflowError for an int past 64 bits, where psycopg's is a DataError.
STORE_ERRORS = (SQLAlchemyError, OverflowError)


def never_storable(err: Exception) -> bool:
    """True for an error the same data would meet again: a value its column cannot hold
    (DataError, OverflowError), a constraint (IntegrityError), or a value the driver
    cannot send. Outages (is_unavailable) are not: those are retried."""
    if isinstance(err, OverflowError):
        return True
    if not isinstance(err, SQLAlchemyError) or is_unavailable(err):
        return False
    return isinstance(err, DataError | IntegrityError) or type(err) is StatementError
