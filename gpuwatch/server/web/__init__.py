"""The web dashboard served by ``gpuwatch server`` at ``/``, and the offline API docs.

Server-rendered HTML with inline SVG charts (no front-end build, no CDN): views.py
(the routes), service.py (the dashboard's grouped reads), charts.py (SVG),
templates/ (HTML), static/ (one stylesheet, one small script), auth.py (the read
token in a browser), docs.py (Swagger UI from local assets). See
docs/dashboard.md.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.staticfiles import StaticFiles

from gpuwatch.server.web.auth import LoginRequired
from gpuwatch.server.web.docs import install_docs
from gpuwatch.server.web.templates.layout import STATIC
from gpuwatch.server.web.views import login_required, pages, public

STATIC_DIR = Path(__file__).resolve().parent / "static"


def install(app: FastAPI) -> None:
    """Add the dashboard, its static files and the API docs pages to ``app``."""
    app.mount(STATIC, StaticFiles(directory=STATIC_DIR), name="dashboard-static")
    install_docs(app)
    app.include_router(public)
    app.include_router(pages)
    app.add_exception_handler(LoginRequired, login_required)
