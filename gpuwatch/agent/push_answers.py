"""What a push's answer says, read for the reporter: the per-snapshot results of an
ingest answer (or that the answer is not one: a proxy's page settles nothing), the
server's ``detail`` and ``Retry-After``, and every text from the server made safe to log
(escaped, cut), since a server, or whatever answers in its place, writes it."""

from __future__ import annotations

import email.utils
import json
from datetime import UTC

from pydantic import ValidationError

from gpuwatch.agent.http_post import Reply
from gpuwatch.terminal_text import printable
from gpuwatch.wire import CLOCK_SKEW_PROBLEM, OTHER_HOST_DETAIL, IngestResponse

# The most of an error answer read for its ``detail``, and of any text from the server
# quoted in the log.
MAX_ERROR_BODY_BYTES = 16 * 2**10
MAX_LOGGED_CHARS = 200
# A buggy or hostile Retry-After must not silence the agent for days.
MAX_RETRY_AFTER_SECONDS = 3600.0


def results(response: Reply, sent: int) -> list[str] | None:
    """What the server answered for each snapshot of the batch: ``accepted``, ``late`` or
    ``duplicate`` (each delivered), or ``deferred`` (not stored); ``None`` when the body
    is not an ingest answer at all (not a JSON object with integer ``accepted`` and
    ``duplicate``, which every gpuwatch server sends). All ``accepted`` when it is one
    but does not cover the batch item by item (a server older than ``results``): a 2xx
    ingest answer stored the batch (the server answers ``deferred`` only to a request
    carrying ``Gpuwatch-Partial``, which this agent always sends)."""
    try:
        body = json.loads(response.content)
    except ValueError:  # UnicodeDecodeError included
        return None
    if not isinstance(body, dict) or not all(
        type(body.get(count)) is int for count in ("accepted", "duplicate")
    ):
        return None
    try:
        results: list[str] = list(IngestResponse.model_validate(body).results)
    except ValidationError:
        results = []
    if len(results) != sent:
        return ["accepted"] * sent
    return results


def not_ingest_answer(response: Reply) -> str:
    """The log's words for a 2xx that is not an ingest answer."""
    content_type = response.headers.get("Content-Type") or "no Content-Type"
    return (
        f"HTTP {response.status} with {shown(content_type)}, not a gpuwatch ingest answer:"
        " is server_url the gpuwatch server's base URL?"
    )


def server_detail(response: Reply) -> str | None:
    """The ``detail`` string of a JSON error answer (``{"detail": "..."}``), escaped
    and cut for one log line; None when the answer has none."""
    detail = raw_detail(response)
    return None if detail is None else shown(detail)


def token_host(response: Reply) -> str | None:
    """The token's host, escaped, when a 403 says the batch names another host."""
    detail = raw_detail(response) if response.status == 403 else None
    if detail is None or not detail.startswith(OTHER_HOST_DETAIL):
        return None
    return shown(detail.removeprefix(OTHER_HOST_DETAIL)) or None


def raw_detail(response: Reply) -> str | None:
    """The answer's ``detail`` as the server wrote it: not for a log line as it is."""
    try:
        body = json.loads(response.content[:MAX_ERROR_BODY_BYTES])
    except ValueError:
        return None
    detail = body.get("detail") if isinstance(body, dict) else None
    return detail if isinstance(detail, str) else None


def clock_skew_indices(response: Reply) -> list[int]:
    """The snapshots (their places in the batch) a 422 refuses as collected too far in
    the server's future: the ``loc`` ``["body", "snapshots", i]`` of its problems of
    type ``clock_skew``. Empty for any other answer."""
    if response.status != 422:
        return []
    try:
        body = json.loads(response.content[:MAX_ERROR_BODY_BYTES])
    except ValueError:
        return []
    problems = body.get("detail") if isinstance(body, dict) else None
    indices: list[int] = []
    for problem in problems if isinstance(problems, list) else []:
        if not isinstance(problem, dict) or problem.get("type") != CLOCK_SKEW_PROBLEM:
            continue
        loc = problem.get("loc")
        if isinstance(loc, list) and len(loc) == 3 and loc[:2] == ["body", "snapshots"]:
            index = loc[2]
            if type(index) is int:
                indices.append(index)
    return indices


def collected_at_of(body: bytes) -> float | None:
    """The ``collected_at`` of a spooled snapshot; None when it cannot be read."""
    try:
        collected_at = json.loads(body).get("collected_at")
    except (ValueError, AttributeError):
        return None
    ok = isinstance(collected_at, int | float) and not isinstance(collected_at, bool)
    return float(collected_at) if ok else None


def server_clock_offset(response: Reply, now_epoch: float) -> float | None:
    """How far the server's clock (its ``Date`` header, to the second) is ahead of
    ``now_epoch`` (negative: behind); None without a readable ``Date``."""
    value = response.headers.get("Date")
    if value is None:
        return None
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return when.timestamp() - now_epoch


def hostname_of(body: bytes) -> str | None:
    """The ``hostname`` of a spooled snapshot; None when it cannot be read."""
    try:
        hostname = json.loads(body).get("hostname")
    except (ValueError, AttributeError):
        return None
    return hostname if isinstance(hostname, str) else None


def shown(text: str) -> str:
    """Text from the server as the log may show it: escaped, and cut."""
    cut = text[:MAX_LOGGED_CHARS]
    return printable(cut) + ("..." if len(text) > MAX_LOGGED_CHARS else "")


def retry_after_seconds(value: str | None, now_epoch: float) -> float | None:
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
