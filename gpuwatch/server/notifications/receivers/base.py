"""The receiver protocol, the factory, and what every HTTP receiver shares.

A receiver makes ONE HTTP attempt per call and says what it came to, as an
:class:`~gpuwatch.server.notifications.model.Attempt`: ``sent``, ``retry`` (with the
receiver's ``Retry-After`` when it gave one) or ``broken``. It never sleeps, never
loops and never raises for a delivery failure; the delivery worker owns retries,
backoff, deadlines and the spacing of ``min_interval_seconds`` between sends.

Outcome classes shared by all receivers (:func:`classify`)::

    2xx                          sent      (Slack also wants the body "ok")
    408, 425, 429, 5xx           retry     (Retry-After honoured: seconds or HTTP date)
    timeout, connection error    retry
    3xx, other 4xx               broken    (redirects are not followed: a moved
                                            endpoint is a configuration to fix)

Receiver URLs and secrets are credentials. Every text a receiver produces goes
through a :class:`Redactor`, and httpx's own request log line (INFO on the ``httpx``
logger, which prints the full URL) is redacted by a filter installed when the first
receiver is built.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from typing import Protocol
from urllib.parse import parse_qsl, unquote, urlsplit

import httpcore
import httpx

from gpuwatch import __version__
from gpuwatch.server.notifications.config import ReceiverConfig
from gpuwatch.server.notifications.model import Attempt, Notification, NotifiedAlert
from gpuwatch.terminal_text import printable

Clock = Callable[[], float]

# Enough of an answer body for an error message; the rest is not read.
MAX_BODY_BYTES = 8 * 2**10
_REASON_CHARS = 120
REDACTED = "<redacted>"
USER_AGENT = f"gpuwatch/{__version__}"


class Receiver(Protocol):
    """Something that can try, once, to deliver a notification."""

    name: str
    type: str
    send_resolved: bool
    # Least time between two sends to this receiver (Slack: 1 message per second).
    min_interval_seconds: float

    def attempt(self, notification: Notification) -> Attempt:
        """One HTTP attempt; no sleeping, no retry loop; never raises for delivery failures."""
        ...


def build_receiver(
    config: ReceiverConfig, *, client: httpx.Client, clock: Clock = time.time
) -> Receiver:
    """The receiver a config describes, sending through ``client`` (owned by the caller).

    ``clock`` (epoch seconds) turns a ``Retry-After`` HTTP date into a delay.
    """
    # Imported here: the receiver modules import this one for the shared helpers.
    from gpuwatch.server.notifications.receivers.alertmanager import AlertmanagerReceiver
    from gpuwatch.server.notifications.receivers.slack import SlackReceiver
    from gpuwatch.server.notifications.receivers.webhook import WebhookReceiver

    kinds: dict[str, type[HttpReceiver]] = {
        "slack": SlackReceiver,
        "webhook": WebhookReceiver,
        "alertmanager": AlertmanagerReceiver,
    }
    return kinds[config.type](config, client=client, clock=clock)


class Redactor:
    """Replaces a receiver's credentials (URL, its path and query, password, secret) in text."""

    def __init__(self, secrets: Iterable[str]) -> None:
        # Longest first, so a URL is replaced whole before its path is.
        self._secrets = sorted({s for s in secrets if s}, key=len, reverse=True)

    # Query values shorter than this are not redacted on their own (see for_config).
    MIN_QUERY_VALUE_CHARS = 4

    @classmethod
    def for_config(cls, config: ReceiverConfig) -> Redactor:
        url = config.url.get_secret_value()
        parts = urlsplit(url)
        secrets = [url, str(httpx.URL(url)), parts.query, parts.password or ""]
        # Each query value on its own (an error body may echo ``token=...`` alone), as
        # written and percent-decoded; very short values ("1", "on") are no secret, and
        # replacing them would garble every message.
        values: list[str] = []
        for piece in parts.query.split("&"):
            value = piece.partition("=")[2]
            values += [value, unquote(value), unquote(value.replace("+", " "))]
        values += [value for _, value in parse_qsl(parts.query, keep_blank_values=True)]
        secrets += [v for v in values if len(v) >= cls.MIN_QUERY_VALUE_CHARS]
        if parts.path not in ("", "/"):
            secrets += [parts.path, unquote(parts.path)]
            # A path segment long enough to be a token (Slack's last segment) on its own.
            secrets += [seg for seg in parts.path.split("/") if len(seg) >= 8]
        if config.secret is not None:
            secrets.append(config.secret.get_secret_value())
        return cls(secrets)

    def __call__(self, text: str) -> str:
        for secret in self._secrets:
            text = text.replace(secret, REDACTED)
        return text


class _HttpxLogRedaction(logging.Filter):
    """Rewrites records of the HTTP client's loggers with every live receiver's redactor.

    httpx logs ``HTTP Request: POST <full URL> ...`` at INFO; for a Slack receiver
    that URL is the credential.
    """

    def __init__(self) -> None:
        super().__init__()
        self.redactors: weakref.WeakSet[Redactor] = weakref.WeakSet()

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        redacted = message
        for redact in list(self.redactors):
            redacted = redact(redacted)
        if redacted != message:
            record.msg, record.args = redacted, ()
        return True


_httpx_log_redaction = _HttpxLogRedaction()


# Loggers that can quote a receiver's URL: httpx's request line (INFO) and httpcore's
# traces (DEBUG: request targets, and answers' headers such as a Location naming the
# URL). A filter on a logger sees only records logged on that very logger, so each is
# named.
_HTTP_LOGGERS = (
    "httpx",
    "httpcore.connection",
    "httpcore.http11",
    "httpcore.http2",
    "httpcore.proxy",
    "httpcore.socks",
)


def guard_logs(redact: Redactor) -> None:
    """Keep ``redact``'s secrets out of httpx's and httpcore's log lines while it lives."""
    for name in _HTTP_LOGGERS:
        logger = logging.getLogger(name)
        if _httpx_log_redaction not in logger.filters:
            logger.addFilter(_httpx_log_redaction)
    _httpx_log_redaction.redactors.add(redact)


@dataclass(frozen=True)
class Reply:
    """What one POST got back: status, headers and the start of the body."""

    status_code: int
    headers: httpx.Headers
    body: bytes


class _Deadline:
    """One attempt's deadline, enforced on the connection's own reads and writes.

    httpx's ``timeout`` bounds each read, not the attempt: an endpoint that answers 200
    and then sends a byte a second kept one attempt going for hours, and with it the
    alert job (evaluation and every other receiver). Through httpcore's ``trace``
    extension the network stream of each new connection is seen as it is opened, and
    its ``read`` and ``write`` are given at most the time left; past the deadline they
    raise httpcore's own timeouts, which httpx reports as usual. The requests say
    ``Connection: close``, so every attempt opens (and so bounds) its own connection.
    """

    def __init__(self, seconds: float) -> None:
        self.at = time.monotonic() + seconds
        self.armed = True

    def left(self, timeout: float | None, expired: type[Exception]) -> float | None:
        """``timeout`` cut to the time left; raises ``expired`` once none is left."""
        if not self.armed:  # the attempt is over; the connection only closes
            return timeout
        left = self.at - time.monotonic()
        if left <= 0:
            raise expired("the attempt's deadline passed")
        return left if timeout is None else min(timeout, left)

    def trace(self, event: str, info: dict[str, object]) -> None:
        if event in ("connection.connect_tcp.complete", "connection.start_tls.complete"):
            self._bound(info["return_value"])

    def _bound(self, stream: object) -> None:
        read, write = getattr(stream, "read", None), getattr(stream, "write", None)
        if read is None or write is None:
            return

        def bounded_read(max_bytes: int, timeout: float | None = None) -> bytes:
            return read(max_bytes, self.left(timeout, httpcore.ReadTimeout))  # type: ignore[no-any-return]

        def bounded_write(buffer: bytes, timeout: float | None = None) -> None:
            write(buffer, self.left(timeout, httpcore.WriteTimeout))

        stream.read = bounded_read  # type: ignore[attr-defined]
        stream.write = bounded_write  # type: ignore[attr-defined]


def post(
    client: httpx.Client,
    url: str,
    *,
    content: bytes,
    headers: dict[str, str],
    timeout: float,
    label: str,
) -> Reply | Attempt:
    """POST once, within ``timeout`` seconds from start to end (connect, send, the
    answer); a transport failure comes back as an :class:`Attempt` instead of raising.

    The detail names the failure's kind, not httpx's message (which can quote the URL).
    """
    deadline = _Deadline(timeout)
    request = client.build_request(
        "POST",
        url,
        content=content,
        headers={**headers, "connection": "close"},
        timeout=timeout,
        extensions={"trace": deadline.trace},
    )
    try:
        response = client.send(request, stream=True, follow_redirects=False)
        try:
            body = b""
            for chunk in response.iter_bytes():
                body += chunk
                if len(body) >= MAX_BODY_BYTES:
                    break
                # Also when the transport is not a network one (no stream to bound).
                deadline.left(None, httpx.ReadTimeout)
        finally:
            deadline.armed = False
            response.close()
    except httpx.TimeoutException as err:
        return Attempt("retry", f"{label}: timed out ({type(err).__name__}, {timeout:g}s)")
    except (httpx.NetworkError, httpx.RemoteProtocolError, httpx.ProxyError) as err:
        return Attempt("retry", f"{label}: connection failed ({type(err).__name__})")
    except httpx.HTTPError as err:
        # InvalidURL, UnsupportedProtocol, LocalProtocolError...: nothing a retry fixes.
        return Attempt("broken", f"{label}: request failed ({type(err).__name__})")
    finally:
        deadline.armed = False
    return Reply(response.status_code, response.headers, body[:MAX_BODY_BYTES])


def parse_retry_after(value: str | None, *, now: float) -> float | None:
    """``Retry-After`` as seconds from ``now``: delta-seconds or an HTTP date; None if unusable.

    A date in the past, or a negative number, is 0 (retry now).
    """
    if value is None:
        return None
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        try:
            seconds = parsedate_to_datetime(value).timestamp() - now
        except (TypeError, ValueError, IndexError, OverflowError):
            return None
    if seconds != seconds or seconds == float("inf"):  # NaN, inf
        return None
    return max(0.0, seconds)


def reason(body: bytes, redact: Redactor) -> str:
    """A short, one-line, credential-free reason from an answer body.

    A JSON object's ``error`` or ``message`` is preferred (Slack, Alertmanager);
    otherwise the text itself, whitespace collapsed and cut.
    """
    text = body.decode("utf-8", errors="replace")
    try:
        data = json.loads(text)
    except ValueError:
        data = None
    if isinstance(data, dict):
        for key in ("error", "message"):
            if isinstance(data.get(key), str):
                text = data[key]
                break
    # One line, its control characters escaped: the body is the receiver's to write,
    # and the reason reaches terminals (``alerts test-receiver``) and the dashboard.
    text = printable(" ".join(redact(text).split()))
    return text if len(text) <= _REASON_CHARS else text[: _REASON_CHARS - 1] + "…"


def classify(
    reply: Reply,
    *,
    label: str,
    redact: Redactor,
    now: float,
    retry_after: float | None = None,
) -> Attempt:
    """The outcome of an answer by its status code (see the module docstring).

    ``retry_after`` is a receiver-specific hint used when the answer has no
    ``Retry-After`` header (Slack's JSON ``retry_after``).
    """
    code = reply.status_code
    why = reason(reply.body, redact)
    detail = f"{label}: HTTP {code}" + (f" {why}" if why else "")
    if 200 <= code < 300:
        return Attempt("sent", detail, status_code=code)
    if code in (408, 425, 429) or code >= 500:
        header = parse_retry_after(reply.headers.get("retry-after"), now=now)
        wait = header if header is not None else retry_after
        if wait is not None:
            detail += f" (retry after {wait:g}s)"
        return Attempt("retry", detail, retry_after=wait, status_code=code)
    if 300 <= code < 400:
        detail += " (redirects are not followed; fix the url)"
    return Attempt("broken", detail, status_code=code)


def sendable_alerts(notification: Notification, *, send_resolved: bool) -> list[NotifiedAlert]:
    """The alerts to send: all of them, or only the firing ones when resolved are not sent."""
    if send_resolved:
        return list(notification.alerts)
    return [a for a in notification.alerts if a.status == "firing"]


class HttpReceiver:
    """What the receivers share: identity, the redactor, one POST, default judging.

    A subclass sets ``type`` (and ``min_interval_seconds`` if it is rate-limited) and
    implements :meth:`request`; it may override :meth:`judge`.
    """

    type: str = ""
    min_interval_seconds: float = 0.0

    def __init__(
        self, config: ReceiverConfig, *, client: httpx.Client, clock: Clock = time.time
    ) -> None:
        if config.type != self.type:
            raise ValueError(f"{config.label()} given to a {self.type} receiver")
        self.name = config.name
        self.send_resolved = config.send_resolved
        self.config = config
        self.label = config.label()
        self.redact = Redactor.for_config(config)
        self._client = client
        self._clock = clock
        # What min_interval_seconds spaces sends by: the endpoint (Slack limits each
        # webhook URL, whichever receivers share it). A digest: the URL is a credential.
        self.spacing_key = (
            "url:" + hashlib.sha256(config.url.get_secret_value().encode()).hexdigest()
        )
        guard_logs(self.redact)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"

    def attempt(self, notification: Notification) -> Attempt:
        """One POST of the notification; see the module docstring for the outcomes."""
        alerts = sendable_alerts(notification, send_resolved=self.send_resolved)
        if not alerts:
            return self.nothing_to_send()
        url, content, headers = self.request(notification, alerts)
        return self.send(url, content, headers)

    def nothing_to_send(self) -> Attempt:
        return Attempt(
            "sent",
            f"{self.label}: nothing to send (only resolved alerts; send_resolved is off)",
        )

    def send(self, url: str, content: bytes, headers: dict[str, str]) -> Attempt:
        """One POST of ``content`` to ``url``, judged."""
        reply = post(
            self._client,
            url,
            content=content,
            headers={"content-type": "application/json", "user-agent": USER_AGENT, **headers},
            timeout=self.config.timeout_seconds,
            label=self.label,
        )
        if isinstance(reply, Attempt):
            return reply
        return self.judge(reply)

    def request(
        self, notification: Notification, alerts: list[NotifiedAlert]
    ) -> tuple[str, bytes, dict[str, str]]:
        """The URL, the body and extra headers of the POST for these alerts."""
        raise NotImplementedError

    def judge(self, reply: Reply) -> Attempt:
        return classify(reply, label=self.label, redact=self.redact, now=self._clock())
