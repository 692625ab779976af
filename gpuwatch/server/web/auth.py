"""Read access for a browser: the read token as a bearer header, or as a cookie that
the login form sets.

When ``read_token`` is unset the pages are open, like the read API. When it is set, a
page needs ``Authorization: Bearer <read_token>`` (as the API does; a wrong one is
403) or the ``gpuwatch_read`` cookie holding the same token. Without either the page
answers 401 with the login form. The cookie is ``HttpOnly`` (no script reads it),
``SameSite=Strict`` (no other site can make the browser send it) and ``Secure`` over
HTTPS, or always when ``cookie_secure`` says so (unset: when ``alerts.external_url`` is
https, as behind a TLS reverse proxy); it lives until the browser closes or the user
signs out. An empty credential never matches. The token is compared
in constant time and never appears in a URL or a log line.

``SameSite=Strict`` also withholds the cookie when a user follows a link from another
site (a chat message about an alert). A second cookie, ``gpuwatch_signed_in``, holds
no secret and is ``Lax``: when it arrives on such a navigation without the token, the
page reloads itself once, now as a same-site navigation, and the token comes along.
"""

from __future__ import annotations

import hmac
import logging
from urllib.parse import parse_qs

from fastapi import HTTPException, Request, status
from starlette.responses import HTMLResponse, RedirectResponse, Response

from gpuwatch.server.deps import Context, ServerContext

log = logging.getLogger(__name__)

COOKIE = "gpuwatch_read"
MARKER = "gpuwatch_signed_in"
# A login form is a token and a path; anything longer is not one.
MAX_FORM_BYTES = 4096


class LoginRequired(Exception):
    """No read credential came with a page request: answered with the login form."""

    def __init__(self, next_path: str, *, rejected: bool, reload: bool) -> None:
        super().__init__("login required")
        self.next_path = next_path
        self.rejected = rejected  # a cookie came, but not the current token
        self.reload = reload  # signed in, but the cookie was withheld (cross-site link)


def token_required(context: ServerContext) -> bool:
    return context.settings.read_token is not None


def _matches(candidate: str, context: ServerContext) -> bool:
    expected = context.settings.read_token
    if expected is None:
        return True
    # An empty credential (``Authorization: Bearer``, an empty cookie) is none at all,
    # whatever the settings hold (they refuse an empty token at start).
    if not candidate:
        return False
    return hmac.compare_digest(candidate.encode(), expected.get_secret_value().encode())


async def require_page_reader(request: Request, context: Context) -> None:
    """Let a page through when reads are open or the request carries the read token."""
    if not token_required(context):
        return
    header = request.headers.get("authorization")
    if header is not None:
        scheme, _, credential = header.partition(" ")
        if scheme.lower() == "bearer" and _matches(credential.strip(), context):
            return
        log.warning("refused dashboard request from %s: wrong read token", _client(request))
        raise HTTPException(status.HTTP_403_FORBIDDEN, detail="wrong read token")
    cookie = request.cookies.get(COOKIE)
    if cookie is not None and _matches(cookie, context):
        return
    cross_site = request.headers.get("sec-fetch-site") == "cross-site"
    raise LoginRequired(
        local_path(request),
        rejected=cookie is not None,
        reload=cookie is None and cross_site and request.cookies.get(MARKER) == "1",
    )


def signed_in(request: Request, context: ServerContext) -> bool:
    """The request carries the read token's cookie (the login form's)."""
    cookie = request.cookies.get(COOKIE)
    return cookie is not None and _matches(cookie, context)


def local_path(request: Request) -> str:
    query = request.url.query
    return request.url.path + (f"?{query}" if query else "")


def safe_next(value: str | None) -> str:
    """``value`` when it is a path on this server, else ``/``: the login form must not
    send anyone to another site."""
    if not value or not value.startswith("/") or value.startswith("//") or "\\" in value:
        return "/"
    if any(ord(c) < 0x20 for c in value):
        return "/"
    return value


async def read_login_form(request: Request) -> tuple[str, str]:
    """The ``token`` and ``next`` fields of a urlencoded login form (413 past 4 KiB)."""
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_FORM_BYTES:
            raise HTTPException(status.HTTP_413_CONTENT_TOO_LARGE, detail="form too large")
    fields = parse_qs(body.decode("utf-8", "replace"), keep_blank_values=True)
    return fields.get("token", [""])[0], fields.get("next", ["/"])[0]


def sign_in(request: Request, token: str, next_path: str) -> Response:
    """303 to ``next_path`` (when it is local) with the cookies set; the caller has
    checked ``token`` with :func:`token_accepted`."""
    response = RedirectResponse(safe_next(next_path), status_code=status.HTTP_303_SEE_OTHER)
    # Behind the documented TLS reverse proxy the server sees plain HTTP: the setting
    # (or an https external_url) says the browser's side is HTTPS.
    context: ServerContext = request.app.state.gpuwatch
    secure = request.url.scheme == "https" or context.settings.cookies_secure()
    response.set_cookie(COOKIE, token, httponly=True, samesite="strict", secure=secure, path="/")
    response.set_cookie(MARKER, "1", httponly=True, samesite="lax", secure=secure, path="/")
    return response


def token_accepted(request: Request, context: ServerContext, token: str) -> bool:
    if token and _matches(token, context):
        return True
    log.warning("refused dashboard login from %s: wrong read token", _client(request))
    return False


def sign_out(root: str) -> Response:
    response = RedirectResponse(f"{root}/login", status_code=status.HTTP_303_SEE_OTHER)
    response.delete_cookie(COOKIE, path="/", httponly=True, samesite="strict")
    response.delete_cookie(MARKER, path="/", httponly=True, samesite="lax")
    return response


def reload_page() -> HTMLResponse:
    """Load the same URL again, now from this site, so the Strict cookie is sent."""
    return HTMLResponse(
        '<!doctype html><meta charset="utf-8"><meta http-equiv="refresh" content="0">'
        "<title>gpuwatch</title><p>Loading…</p>",
        headers={"Cache-Control": "no-store"},
    )


def _client(request: Request) -> str:
    return request.client.host if request.client else "unknown"
