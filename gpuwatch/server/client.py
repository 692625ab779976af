"""Small clients of the server's API: the read API for ``gpuwatch history``, the alert
API for ``gpuwatch alerts``.

Responses are validated into the server's own schemas, so a version mismatch shows
up as one clear error rather than a KeyError. The transport is injectable
(``httpx.MockTransport`` or a live server in tests). HTTP answers become errors here,
at the boundary::

    unreachable, 5xx, not JSON   RemoteError     (exit 5)
    401, 403                     AuthError       (exit 5)
    404 from a route naming one  NotFound        (exit 8: the route answered, with its own
                                                  ``detail``, that it has no such thing)
    404 from no route at all     RemoteError     (exit 5: FastAPI's "Not Found", or not
                                                  JSON: --server is not the base URL)
    422                          ConfigError     (exit 3: the server refused a value we sent)
    a malformed URL or token     ConfigError     (exit 3, before any request: not http(s),
                                                  no host, a port past 65535, not UTF-8)
    a value that is not UTF-8    ConfigError     (exit 3, before any request)
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, TypeVar
from urllib.parse import quote, urlsplit

import httpx
from pydantic import TypeAdapter, ValidationError

from gpuwatch.bearer import bearer_headers, without_secrets
from gpuwatch.errors import AuthError, ConfigError, NotFound, RemoteError
from gpuwatch.server.alerts.schemas import AlertOut, ReceiverOut, SilenceIn, SilenceOut, TestResult
from gpuwatch.server.events.schemas import EventOut, EventPage, IdleHolderOut
from gpuwatch.server.hosts.schemas import HostOut
from gpuwatch.server.processes.schemas import ProcessOut, ProcessPage, ProcessSamples

PAGE_SIZE = 500
P = TypeVar("P", ProcessPage, EventPage)
# FastAPI's detail for a path no route serves; a route's own 404 says what is missing.
NO_ROUTE_DETAIL = "Not Found"


class _ApiClient:
    """One ``httpx.Client`` on ``base_url``, and the translation of its answers."""

    # What a 401/403 message calls the token this client sends.
    token_kind = "read token"

    def __init__(
        self,
        base_url: str,
        *,
        token: str | None = None,
        timeout_seconds: float = 10.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        # Stripped (a token read from a file or the environment often ends in a newline,
        # which httpx refuses with an error quoting the header), and refused up front,
        # without showing it, when it cannot be a header value.
        headers = bearer_headers(token)
        self._headers = headers  # for scrubbing error messages
        self.last_headers = httpx.Headers()  # of the last answer that succeeded
        self._base_url = _checked_base_url(base_url)
        try:
            self._http = httpx.Client(
                base_url=self._base_url,
                headers=headers,
                timeout=timeout_seconds,
                transport=transport,
            )
        except httpx.InvalidURL as err:  # not an httpx.HTTPError: _request would miss it
            raise ConfigError(f"--server {_shown(base_url)!r} is not a URL: {err}") from None
        except UnicodeEncodeError:
            # A header is ASCII; the token is not quoted, it is a credential.
            raise ConfigError(
                "the token has characters a gpuwatch token never has (not ASCII)"
            ) from None

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *_: object) -> None:
        self._http.close()

    def _get(self, path: str, params: dict[str, Any]) -> Any:
        clean = {k: v for k, v in params.items() if v is not None}
        return self._request("GET", path, params=clean)

    @staticmethod
    def _check_filters(filters: dict[str, Any]) -> None:
        """Refuse a filter that cannot be sent (a command-line argument that was not
        UTF-8, such as a Latin-1 file name), naming it as its option: ``host`` is
        ``--host``."""
        for name, value in filters.items():
            if isinstance(value, str):
                _utf8(value, f"--{name.replace('_', '-')}")

    def _request(
        self,
        method: str,
        path: str,
        *,
        params: dict[str, Any] | None = None,
        body: Any = None,
        expect: int = 200,
        not_found: str | None = None,
        refused: str = "the request",
    ) -> Any:
        """Send one request; its JSON answer, or the error it maps to.

        ``not_found`` is the message for a 404 (for routes whose path names something);
        ``refused`` names what a 422 refused ("the silence").
        """
        try:
            response = self._http.request(method, path, params=params, json=body)
        except UnicodeEncodeError:
            # What the callers did not check (their options are checked, by name).
            raise ConfigError("a value to send the server is not valid UTF-8 text") from None
        except httpx.HTTPError as err:
            # httpx's message may quote a header it refused: never show the token.
            raise RemoteError(
                f"cannot reach the gpuwatch server at {self._base_url}: "
                + without_secrets(str(err), self._headers)
            ) from None
        code = response.status_code
        if code in (401, 403):
            raise AuthError(
                f"the server at {self._base_url} refused the {self.token_kind} "
                f"(HTTP {code}: {_detail(response)})"
            )
        if code == 404 and not _route_detail(response):
            # No route answered: the silence or receiver may well exist, at another URL.
            raise RemoteError(
                f"the server at {self._base_url} has no API route {path} (HTTP 404):"
                " is --server the gpuwatch server's base URL?"
            )
        if code == 404 and not_found is not None:
            raise NotFound(f"{not_found} on the server at {self._base_url}")
        if code == 422:
            raise ConfigError(f"the server refused {refused}: {_detail(response)}")
        try:
            data = response.json()
        except ValueError:
            data = _NOT_JSON
        if code != expect and not (200 <= code < 300 and data is _NOT_JSON):
            raise RemoteError(
                f"the server at {self._base_url} answered HTTP {code}: {_detail(response)}"
            )
        if data is _NOT_JSON:  # a 2xx page: a proxy's, a portal's, another service's
            raise RemoteError(
                f"{self._base_url} did not answer JSON (HTTP {code}); is it a gpuwatch server?"
            )
        self.last_headers = response.headers
        return data


class HistoryClient(_ApiClient):
    """Reads ``/api/v1`` of a gpuwatch server at ``base_url``."""

    def __enter__(self) -> HistoryClient:
        return self

    def processes(self, *, limit: int, **filters: Any) -> list[ProcessOut]:
        """Process lifetimes matching ``filters`` (host, gpu, user, at, open), newest first."""
        items: list[ProcessOut] = []
        for page in self._pages("/api/v1/processes", ProcessPage, limit, filters):
            items += page.items
        return items[:limit]

    def process_samples(
        self,
        lifetime_id: int,
        *,
        since: float | None = None,
        until: float | None = None,
        limit: int = 1440,
    ) -> ProcessSamples:
        """Lifetime ``lifetime_id`` and its coarse samples (the newest ``limit`` buckets
        starting in ``[since, until)``, oldest first); :class:`NotFound` when it has none."""
        data = self._request(
            "GET",
            f"/api/v1/processes/{lifetime_id}/samples",
            params={
                k: v
                for k, v in {"since": since, "until": until, "limit": limit}.items()
                if v is not None
            },
            not_found=f"no process lifetime {lifetime_id}",
        )
        return _parse(TypeAdapter(ProcessSamples), data, self._base_url)

    def events(self, *, limit: int, **filters: Any) -> list[EventOut]:
        """Events matching ``filters`` (host, gpu, user, kind, since, until, open)."""
        items: list[EventOut] = []
        for page in self._pages("/api/v1/events", EventPage, limit, filters):
            items += page.items
        return items[:limit]

    def hostnames(self) -> list[str]:
        """Every host the server knows (``/api/v1/hosts``), retired ones included."""
        data = self._get("/api/v1/hosts", {})
        return [host.hostname for host in _parse(TypeAdapter(list[HostOut]), data, self._base_url)]

    def top_idle(self, *, since: float, until: float | None, limit: int) -> list[IdleHolderOut]:
        """Users ranked by idle byte-seconds in ``[since, until]``."""
        params = {"since": since, "until": until, "limit": limit}
        data = self._get("/api/v1/events/top-idle", params)
        return _parse(TypeAdapter(list[IdleHolderOut]), data, self._base_url)

    def _pages(self, path: str, model: type[P], limit: int, filters: dict[str, Any]) -> Iterator[P]:
        """Follow ``next_cursor`` until ``limit`` items or the last page."""
        params = {k: v for k, v in filters.items() if v is not None and v is not False}
        self._check_filters(params)
        params["limit"] = min(limit, PAGE_SIZE)
        fetched = 0
        while True:
            page: P = _parse(TypeAdapter(model), self._get(path, params), self._base_url)
            yield page
            fetched += len(page.items)
            if page.next_cursor is None or fetched >= limit:
                return
            params["cursor"] = page.next_cursor


class AlertsClient(_ApiClient):
    """Alerts, silences and receivers of a gpuwatch server (``/api/v1``).

    Reads need the read token (when the server sets one); changes (silences, receiver
    tests) the admin token, or the read token where the server sets no admin token.
    Pass the token the calls need.
    """

    token_kind = "token"
    # test_receiver waits the longest receiver timeout and this much more.
    test_margin_seconds = 15.0

    def __enter__(self) -> AlertsClient:
        return self

    def alerts(self, *, state: str = "active") -> tuple[list[AlertOut], int]:
        """Alerts in ``state`` (active, firing, pending, resolved), most severe first, and
        how many there are: the server lists at most 1,000."""
        data = self._get("/api/v1/alerts", {"state": state})
        alerts = _parse(TypeAdapter(list[AlertOut]), data, self._base_url)
        try:
            total = int(self.last_headers.get("X-Total-Count", len(alerts)))
        except ValueError:  # a server without the header, or a proxy that mangled it
            total = len(alerts)
        return alerts, max(total, len(alerts))

    def silences(self, *, expired: bool = False) -> list[SilenceOut]:
        """Current and future silences (and ended ones with ``expired``), latest end first."""
        data = self._get("/api/v1/silences", {"expired": "true" if expired else None})
        return _parse(TypeAdapter(list[SilenceOut]), data, self._base_url)

    def create_silence(self, silence: SilenceIn) -> SilenceOut:
        """Create ``silence``; a value the server refuses is a :class:`ConfigError`."""
        data = self._request(
            "POST",
            "/api/v1/silences",
            body=silence.model_dump(mode="json", exclude_none=True),
            expect=201,
            refused="the silence",
        )
        return _parse(TypeAdapter(SilenceOut), data, self._base_url)

    def expire_silence(self, silence_id: int) -> SilenceOut:
        """End silence ``silence_id`` now (:class:`NotFound` when there is none)."""
        data = self._request(
            "DELETE", f"/api/v1/silences/{silence_id}", not_found=f"no silence {silence_id}"
        )
        return _parse(TypeAdapter(SilenceOut), data, self._base_url)

    def receivers(self) -> list[ReceiverOut]:
        """The configured receivers and how their deliveries went (never URLs or secrets)."""
        data = self._get("/api/v1/receivers", {})
        return _parse(TypeAdapter(list[ReceiverOut]), data, self._base_url)

    def test_receiver(self, name: str) -> TestResult:
        """Have the server send a sample notification to receiver ``name`` once."""
        from gpuwatch.server.notifications.config import MAX_TIMEOUT_SECONDS

        # The server answers once the receiver has: wait longer than any receiver may
        # take (its timeout_seconds, at most MAX_TIMEOUT_SECONDS), with a margin for
        # Slack's spacing and the server's own work. A slow receiver is its outcome,
        # not "cannot reach the gpuwatch server".
        _utf8(name, "the receiver name")
        previous = self._http.timeout
        self._http.timeout = httpx.Timeout(
            MAX_TIMEOUT_SECONDS + self.test_margin_seconds, connect=previous.connect
        )
        try:
            data = self._request(
                "POST",
                f"/api/v1/receivers/{quote(name, safe='')}/test",
                not_found=f"no receiver {name!r}",
            )
        finally:
            self._http.timeout = previous
        return _parse(TypeAdapter(TestResult), data, self._base_url)


_NOT_JSON = object()


def _checked_base_url(given: str) -> str:
    """``given`` without its trailing slash, once it is an http(s) URL with a host and
    a port that can exist; :class:`ConfigError` (exit 3) otherwise, before any request:
    ``ftp://host``, ``127.0.0.1:9403`` (no scheme), ``''`` or port 99999 are a wrong
    option value, not an unreachable server."""
    _utf8(given, "--server")
    try:
        parts = urlsplit(given.strip())
        parts.port  # noqa: B018 - ValueError when not a number from 0 to 65535
    except ValueError as err:
        raise ConfigError(f"--server {_shown(given)!r} is not a URL: {err}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(
            f"--server {_shown(given)!r} is not an http:// or https:// URL with a host"
            " (such as http://gpuwatch-server:9403)"
        )
    return given.strip().rstrip("/")


def _utf8(value: str, what: str) -> str:
    """``value``, or :class:`ConfigError` naming ``what`` when it cannot be sent: an
    argument given as bytes that are not UTF-8 (Python keeps them as lone surrogates)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        # repr shows the stray bytes as escapes ('\udcff'); main() escapes the rest.
        raise ConfigError(f"{what} is not valid UTF-8 text: {_shown(value)!r}") from None
    return value


def _shown(text: str) -> str:
    """A value as an error may quote it (with ``!r``): cut."""
    return text if len(text) <= 100 else text[:97] + "..."


def _route_detail(response: httpx.Response) -> bool:
    """Whether a 404 came from a route saying what it has not (a JSON ``detail`` of its
    own), rather than from no route at all."""
    try:
        detail = response.json().get("detail")
    except (ValueError, AttributeError):
        return False
    return isinstance(detail, str) and detail != NO_ROUTE_DETAIL


def _parse(adapter: TypeAdapter[Any], data: Any, base_url: str) -> Any:
    try:
        return adapter.validate_python(data)
    except ValidationError as err:
        raise RemoteError(
            f"unexpected answer from {base_url} (a different gpuwatch version?): "
            f"{err.errors()[0]['msg']}"
        ) from err


def _detail(response: httpx.Response) -> str:
    """The server's ``detail``, on one line: a string, or FastAPI's list of problems."""
    try:
        detail = response.json().get("detail")
    except (ValueError, AttributeError):
        detail = None
    if isinstance(detail, list):
        detail = "; ".join(_problem(item) for item in detail[:3])
    text = " ".join(str(detail).split()) if detail else response.reason_phrase
    return text[:200]


def _problem(item: Any) -> str:
    if not isinstance(item, dict):
        return str(item)
    # loc is ["body", "matchers", 0, "name"]: the part after "body" names the field.
    loc = [str(part) for part in item.get("loc", []) if part not in ("body", "query", "path")]
    message = str(item.get("msg", "invalid")).removeprefix("Value error, ")
    return f"{'.'.join(loc)}: {message}" if loc else message
