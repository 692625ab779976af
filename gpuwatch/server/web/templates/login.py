"""The login form shown (with 401) when ``read_token`` is set and no token came."""

from __future__ import annotations

from html import escape as e

from gpuwatch.server.web.templates.layout import STATIC


def login_page(root: str, *, next_path: str, message: str | None) -> str:
    problem = f'<p class="error" role="alert">{e(message)}</p>' if message else ""
    r = e(root)
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        "<title>Sign in · gpuwatch</title>"
        f'<link rel="icon" href="{r}{STATIC}/favicon.svg" type="image/svg+xml">'
        f'<link rel="stylesheet" href="{r}{STATIC}/dashboard.css"></head>'
        '<body class="login"><main><h1>gpuwatch</h1>'
        "<p>This server requires its read token to show the dashboard.</p>"
        f'{problem}<form method="post" action="{r}/login">'
        f'<input type="hidden" name="next" value="{e(next_path)}">'
        '<label>Read token <input type="password" name="token" autocomplete="current-password" '
        'required autofocus></label><button type="submit">Sign in</button></form>'
        '<p class="muted">The token is kept in a cookie only this site can send, '
        "until you close the browser or sign out.</p></main></body></html>"
    )
