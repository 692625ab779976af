"""The ``Authorization`` header that the agent and the CLI send the server, built one way.

Beside ``gpuwatch/snapshot.py`` because both sides use it (tests/test_boundaries.py):
the agent's pushes and reports, and the CLI's client of the server's API.
"""

from __future__ import annotations

from gpuwatch.errors import ConfigError


def bearer_headers(token: str | None) -> dict[str, str]:
    """The ``Authorization`` header for ``token``, which is stripped of surrounding
    whitespace first: a token read from a file, an environment variable or a Kubernetes
    secret usually ends in a newline, and HTTP clients refuse such a header with an
    error that quotes it (the token, in a log). Raises :class:`ConfigError`, never
    showing the token, when what is left cannot be a header value (gpuwatch tokens are
    printable ASCII without spaces); none for an empty token."""
    token = (token or "").strip()
    if not token:
        return {}
    if any(not "!" <= char <= "~" for char in token):
        raise ConfigError(
            "the token has characters a gpuwatch token never has"
            " (spaces, control characters, or not ASCII)"
        )
    return {"Authorization": f"Bearer {token}"}


def without_secrets(message: str, headers: dict[str, str]) -> str:
    """``message`` with the value of any ``Authorization`` header, or its token, cut
    out: for errors whose text may quote the request (defence in depth)."""
    for name, value in headers.items():
        if name.lower() != "authorization":
            continue
        for secret in (value, *value.split()[1:]):
            if secret:
                message = message.replace(secret, "<redacted>")
    return message
