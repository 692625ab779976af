"""POST a body to the central server with the standard library's HTTP client.

The agent sends two kinds of request (a batch of snapshots, an event) and reads a
status, one header and a small JSON answer. httpx would do it too, but importing it
costs the agent process about 6 MiB of its 40 MiB budget (bench/README.md, "Agent
RSS"), so the agent keeps to ``urllib.request`` and httpx stays in the server and the
command line.

What is kept from the httpx client used before: TLS verification against
``SSL_CERT_FILE`` or ``SSL_CERT_DIR`` when set, else certifi's bundle; proxies from
``HTTP_PROXY`` / ``HTTPS_PROXY`` / ``ALL_PROXY`` / ``NO_PROXY``; redirects are not
followed (a 3xx is an answer like any other); one timeout for connecting and for
each read and write.

An :class:`Unreachable`'s message is escaped (:func:`~gpuwatch.terminal_text.printable`)
and cut: it may quote what the other end sent (a malformed status line), which must not
put ESC, NUL, CR or LF into the agent's log.
"""

from __future__ import annotations

import http.client
import os
import ssl
import urllib.error
import urllib.request
from dataclasses import dataclass
from email.message import Message
from urllib.parse import urlsplit, urlunsplit

from gpuwatch.bearer import without_secrets
from gpuwatch.errors import ConfigError
from gpuwatch.terminal_text import printable

# The most of an error's text an Unreachable quotes.
MAX_REASON_CHARS = 300


class Unreachable(Exception):
    """No HTTP answer: refused, reset, timed out, TLS failed, or not HTTP."""


@dataclass(frozen=True)
class Reply:
    """An HTTP answer, whatever its status."""

    status: int
    headers: Message
    content: bytes

    @property
    def is_success(self) -> bool:
        return 200 <= self.status < 300


@dataclass(frozen=True)
class Endpoint:
    """A server URL as requests use it (``url``, credentials removed: the agent
    authenticates with its token) and as logs may show it (``shown``)."""

    url: str
    shown: str

    @classmethod
    def parse(cls, server_url: str | None, path: str) -> Endpoint:
        """``server_url`` plus ``path``. Raises ConfigError unless an http(s) URL with a host."""
        if not server_url:
            raise ConfigError("the reporter needs server_url")
        try:
            parts = urlsplit(server_url.strip())
            port = parts.port  # ValueError when not a number in range
        except ValueError as err:
            raise ConfigError(f"invalid server_url: {err}") from err
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError("server_url must be an http:// or https:// URL with a host")
        try:
            # What the request will need; refused here, not as "unreachable" on every try.
            parts.hostname.encode("idna")
        except UnicodeError:
            raise ConfigError("server_url: its host is not a valid host name") from None
        netloc = parts.hostname if ":" not in parts.hostname else f"[{parts.hostname}]"
        if port is not None:
            netloc += f":{port}"
        base = urlunsplit((parts.scheme, netloc, parts.path, "", "")).rstrip("/")
        return cls(url=base + path, shown=base)


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: object, **kwargs: object) -> None:
        return None  # the 3xx is raised as HTTPError, and answered as it is


def _tls_context() -> ssl.SSLContext:
    """Verify the server as httpx does by default (``trust_env``)."""
    if os.environ.get("SSL_CERT_FILE"):
        return ssl.create_default_context(cafile=os.environ["SSL_CERT_FILE"])
    if os.environ.get("SSL_CERT_DIR"):
        return ssl.create_default_context(capath=os.environ["SSL_CERT_DIR"])
    try:
        import certifi
    except ImportError:  # pragma: no cover - installed with httpx, a dependency
        return ssl.create_default_context()
    return ssl.create_default_context(cafile=certifi.where())


class Poster:
    """Sends POSTs; one connection each (the server's keep-alive, 5 s, is shorter than
    the push interval, so a kept connection would rarely be reused)."""

    def __init__(self, *, timeout_seconds: float) -> None:
        self._timeout = timeout_seconds
        self._opener: urllib.request.OpenerDirector | None = None

    def post(self, url: str, body: bytes, headers: dict[str, str]) -> Reply:
        """POST ``body``; any status is a :class:`Reply`. Raises :class:`Unreachable`."""
        if self._opener is None:
            # Built at first use: the CA bundle is read once, and not by agents that
            # never push.
            self._opener = urllib.request.build_opener(
                urllib.request.ProxyHandler(),
                urllib.request.HTTPSHandler(context=_tls_context()),
                _NoRedirects(),
            )
        request = urllib.request.Request(url, data=body, headers=headers, method="POST")
        try:
            with self._opener.open(request, timeout=self._timeout) as response:
                return Reply(response.status, response.headers, response.read())
        except urllib.error.HTTPError as err:
            with err:
                try:
                    content = err.read()
                except (OSError, http.client.HTTPException):
                    content = b""  # the status and headers are the answer
                return Reply(err.code, err.headers, content)
        # The reason may quote a header the client refused: never the token.
        except urllib.error.URLError as err:
            raise Unreachable(_reason(err.reason, headers)) from None
        except (OSError, http.client.HTTPException, ValueError) as err:
            # OSError: a timeout or reset while reading; HTTPException: not HTTP;
            # ValueError: a proxy setting urllib cannot use, or a header value it refuses.
            raise Unreachable(_reason(err, headers)) from None

    def close(self) -> None:
        self._opener = None


def _reason(reason: object, headers: dict[str, str]) -> str:
    """Why a request got no answer, for one log line (see the module docstring): the
    secrets cut out first, while the token is still whole in the text."""
    text = without_secrets(str(reason) or type(reason).__name__, headers)
    cut = printable(text[:MAX_REASON_CHARS])
    return cut + ("..." if len(text) > MAX_REASON_CHARS else "")
