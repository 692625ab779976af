"""A small client of the server's read API, for ``gpuwatch history``.

Responses are validated into the server's own schemas, so a version mismatch shows
up as one clear error rather than a KeyError. The transport is injectable
(``httpx.MockTransport`` or a live server in tests).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, TypeVar

import httpx
from pydantic import TypeAdapter, ValidationError

from gpuwatch.errors import AuthError, RemoteError
from gpuwatch.server.events.schemas import EventOut, EventPage, IdleHolderOut
from gpuwatch.server.processes.schemas import ProcessOut, ProcessPage

PAGE_SIZE = 500
P = TypeVar("P", ProcessPage, EventPage)


class HistoryClient:
    """Reads ``/api/v1`` of a gpuwatch server at ``base_url``."""

    def __init__(
        self,
        base_url: str,
        *,
        token: str | None = None,
        timeout_seconds: float = 10.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._base_url = base_url.rstrip("/")
        self._http = httpx.Client(
            base_url=self._base_url, headers=headers, timeout=timeout_seconds, transport=transport
        )

    def __enter__(self) -> HistoryClient:
        return self

    def __exit__(self, *_: object) -> None:
        self._http.close()

    def processes(self, *, limit: int, **filters: Any) -> list[ProcessOut]:
        """Process lifetimes matching ``filters`` (host, gpu, user, at, open), newest first."""
        items: list[ProcessOut] = []
        for page in self._pages("/api/v1/processes", ProcessPage, limit, filters):
            items += page.items
        return items[:limit]

    def events(self, *, limit: int, **filters: Any) -> list[EventOut]:
        """Events matching ``filters`` (host, gpu, user, kind, since, until, open)."""
        items: list[EventOut] = []
        for page in self._pages("/api/v1/events", EventPage, limit, filters):
            items += page.items
        return items[:limit]

    def top_idle(self, *, since: float, until: float | None, limit: int) -> list[IdleHolderOut]:
        """Users ranked by idle byte-seconds in ``[since, until]``."""
        params = {"since": since, "until": until, "limit": limit}
        data = self._get("/api/v1/events/top-idle", params)
        return _parse(TypeAdapter(list[IdleHolderOut]), data, self._base_url)

    def _pages(self, path: str, model: type[P], limit: int, filters: dict[str, Any]) -> Iterator[P]:
        """Follow ``next_cursor`` until ``limit`` items or the last page."""
        params = {k: v for k, v in filters.items() if v is not None and v is not False}
        params["limit"] = min(limit, PAGE_SIZE)
        fetched = 0
        while True:
            page: P = _parse(TypeAdapter(model), self._get(path, params), self._base_url)
            yield page
            fetched += len(page.items)
            if page.next_cursor is None or fetched >= limit:
                return
            params["cursor"] = page.next_cursor

    def _get(self, path: str, params: dict[str, Any]) -> Any:
        clean = {k: v for k, v in params.items() if v is not None}
        try:
            response = self._http.get(path, params=clean)
        except httpx.HTTPError as err:
            raise RemoteError(
                f"cannot reach the gpuwatch server at {self._base_url}: {err}"
            ) from err
        if response.status_code in (401, 403):
            raise AuthError(
                f"the server at {self._base_url} refused the read token (HTTP {response.status_code})"
            )
        if response.status_code != 200:
            raise RemoteError(
                f"the server at {self._base_url} answered HTTP {response.status_code}: "
                f"{_detail(response)}"
            )
        try:
            return response.json()
        except ValueError as err:
            raise RemoteError(
                f"{self._base_url} did not answer JSON; is it a gpuwatch server?"
            ) from err


def _parse(adapter: TypeAdapter[Any], data: Any, base_url: str) -> Any:
    try:
        return adapter.validate_python(data)
    except ValidationError as err:
        raise RemoteError(
            f"unexpected answer from {base_url} (a different gpuwatch version?): "
            f"{err.errors()[0]['msg']}"
        ) from err


def _detail(response: httpx.Response) -> str:
    try:
        detail = response.json().get("detail")
    except (ValueError, AttributeError):
        detail = None
    return str(detail)[:200] if detail else response.reason_phrase
