"""The API documentation page (Swagger UI at ``/docs``) with its assets served by this
server.

FastAPI's own page loads Swagger UI from a CDN, so it is blank where the server has no
internet. The assets come from the ``fastapi-offline`` package (Swagger UI is
Apache-2.0), mounted under ``/static/apidocs``. Like ``/openapi.json`` the page is
open: it holds no fleet data.

There is no ``/redoc``: ReDoc's bundle fetches its logo from its CDN whatever it is
told, so it cannot be offline, and ``/docs`` documents the same schema.
"""

from __future__ import annotations

from pathlib import Path

import fastapi_offline
from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
from fastapi.staticfiles import StaticFiles
from starlette.responses import HTMLResponse

ASSETS = Path(fastapi_offline.__file__).resolve().parent / "static"
ASSETS_URL = "/static/apidocs"
DOCS_URL = "/docs"
OAUTH2_REDIRECT_URL = "/docs/oauth2-redirect"
# The pages' headers (web/views.py HEADERS) but their script rule: Swagger UI starts
# from an inline script. Its "Try it out" form sends calls with a token the user typed,
# so no other site may frame it.
DOCS_HEADERS = {
    "Cache-Control": "no-store",
    "Content-Security-Policy": "frame-ancestors 'none'",
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
}


def install_docs(app: FastAPI) -> None:
    """Serve the docs page and its assets; create the app with ``docs_url=None`` and
    ``redoc_url=None`` so FastAPI's CDN pages are not registered too."""
    app.mount(ASSETS_URL, StaticFiles(directory=ASSETS), name="apidocs")
    openapi_url = app.openapi_url or "/openapi.json"

    @app.get(DOCS_URL, include_in_schema=False)
    async def swagger_ui(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        page = get_swagger_ui_html(
            openapi_url=root + openapi_url,
            title=f"{app.title} - API",
            swagger_js_url=f"{root}{ASSETS_URL}/swagger-ui-bundle.js",
            swagger_css_url=f"{root}{ASSETS_URL}/swagger-ui.css",
            swagger_favicon_url=f"{root}{ASSETS_URL}/favicon.png",
            oauth2_redirect_url=root + OAUTH2_REDIRECT_URL,
            swagger_ui_parameters=app.swagger_ui_parameters,
        )
        page.headers.update(DOCS_HEADERS)
        return page

    @app.get(OAUTH2_REDIRECT_URL, include_in_schema=False)
    async def swagger_ui_redirect() -> HTMLResponse:
        page = get_swagger_ui_oauth2_redirect_html()
        page.headers.update(DOCS_HEADERS)
        return page
