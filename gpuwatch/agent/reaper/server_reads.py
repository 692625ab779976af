"""The two reads of the central server's API the agent's policy makes, over ``urllib``.

``GET /api/v1/processes?host=&gpu=&open=true`` (lifetimes, paged by ``next_cursor``)
and ``GET /api/v1/processes/{id}/samples`` (a lifetime's coarse buckets): the
:class:`~gpuwatch.agent.reaper.central.ReadApi` that
:class:`~gpuwatch.agent.reaper.central.ServerHistory` asks. The command line reads the
same routes with ``gpuwatch.server.client.HistoryClient``; the agent cannot import the
server's package, and keeps httpx out of its process (its memory budget), so it reads
with the standard library and parses only the fields the reaper uses.

Answers become errors here, at the boundary, as the command line's client maps them::

    unreachable, 5xx, not JSON, not the expected shape   RemoteError
    401, 403                                            AuthError
    404 on a lifetime's samples                         NotFound
"""

from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from gpuwatch.errors import AuthError, NotFound, RemoteError

PAGE_SIZE = 500  # the route's largest page
MAX_PAGES = 20  # 10,000 lifetimes on one GPU is far beyond any real host

M = TypeVar("M", bound=BaseModel)


class _Read(BaseModel):
    # Only what the reaper uses; the server may add fields.
    model_config = ConfigDict(extra="ignore", frozen=True)


class LifetimeRead(_Read):
    id: int
    hostname: str
    gpu_index: int
    gpu_uuid: str
    pid: int
    start_time: float | None
    first_seen_at: float
    last_seen_at: float


class BucketRead(_Read):
    t: float
    used_bytes: int | None
    sm_ratio: float | None


class SamplesRead(_Read):
    lifetime: LifetimeRead
    sample_interval_seconds: float
    samples: list[BucketRead]


class _Page(_Read):
    items: list[LifetimeRead]
    next_cursor: str | None


class ServerReads:
    """Reads ``/api/v1`` of the server at ``base_url`` with the read token (``None``: a
    server that sets no read token). ``requests`` counts the HTTP requests made."""

    def __init__(self, base_url: str, *, token: str | None, timeout_seconds: float) -> None:
        self._base = base_url.rstrip("/")
        self._headers = {"Accept": "application/json"}
        if token:
            self._headers["Authorization"] = f"Bearer {token}"
        self._timeout = timeout_seconds
        self.requests = 0

    def processes(self, *, limit: int, **filters: Any) -> Sequence[LifetimeRead]:
        """Lifetimes matching ``filters`` (host, gpu, open), newest first, at most ``limit``."""
        params = {k: _param(v) for k, v in filters.items() if v is not None}
        params["limit"] = str(min(limit, PAGE_SIZE))
        items: list[LifetimeRead] = []
        for _ in range(MAX_PAGES):
            page = _parse(_Page, self._get("/api/v1/processes", params), self._base)
            items += page.items
            if page.next_cursor is None or len(items) >= limit:
                break
            params["cursor"] = page.next_cursor
        return items[:limit]

    def process_samples(
        self, lifetime_id: int, *, since: float | None = None, limit: int = 1440
    ) -> SamplesRead:
        """Lifetime ``lifetime_id`` and its buckets from ``since``; NotFound when gone."""
        params = {"limit": str(limit)}
        if since is not None:
            params["since"] = repr(float(since))
        data = self._get(f"/api/v1/processes/{lifetime_id}/samples", params, found=True)
        return _parse(SamplesRead, data, self._base)

    def _get(self, path: str, params: dict[str, str], *, found: bool = False) -> Any:
        url = f"{self._base}{path}?{urllib.parse.urlencode(params)}"
        request = urllib.request.Request(url, headers=self._headers, method="GET")
        self.requests += 1
        try:
            with urllib.request.urlopen(request, timeout=self._timeout) as response:
                body = response.read()
        except urllib.error.HTTPError as err:
            err.close()
            if err.code in (401, 403):
                raise AuthError(
                    f"the server at {self._base} refused the read token (HTTP {err.code})"
                ) from None
            if err.code == 404 and found:
                raise NotFound(f"{path} is gone from the server at {self._base}") from None
            raise RemoteError(f"the server at {self._base} answered HTTP {err.code}") from None
        except (urllib.error.URLError, OSError, http.client.HTTPException, ValueError) as err:
            reason = getattr(err, "reason", err)
            raise RemoteError(
                f"cannot reach the gpuwatch server at {self._base}: {reason}"
            ) from err
        try:
            return json.loads(body)
        except ValueError as err:
            raise RemoteError(
                f"{self._base} did not answer JSON; is it a gpuwatch server?"
            ) from err


def _param(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _parse(model: type[M], data: Any, base: str) -> M:
    try:
        return model.model_validate(data)
    except ValidationError as err:
        raise RemoteError(
            f"the server at {base} answered in an unexpected shape "
            f"({err.error_count()} problem(s)); is it the same gpuwatch version?"
        ) from None
