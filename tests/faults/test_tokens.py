"""Tokens are compared in constant time and never logged, for every kind of token.

Real server over HTTP, with ``read_token`` and ``admin_token`` set and an agent token
in the database. Constant time is checked where it is decided: every comparison of a
presented token goes through :func:`hmac.compare_digest` (a spy wraps the real one),
and an agent token is only ever compared as its SHA-256 digest. Logs are captured at
DEBUG from every logger (the server's, uvicorn's, httpx's) across right, wrong,
missing and other-host tokens. Agent tokens in ingest logs alone are already covered
by ``tests/server/test_ingest_rejects.py::TestAuthentication::test_tokens_never_reach_logs_or_the_database``;
this adds the read and admin tokens and the comparison itself.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from pydantic import SecretStr
from server.factories import body
from support.clock import FakeClock

from faults.central import T0, Central, central, host_snapshot

READ = "read-token-" + "R" * 32
ADMIN = "admin-token-" + "A" * 32
WRONG = "wrong-token-" + "W" * 32


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Central]:
    clock = FakeClock(T0)
    with central(
        f"sqlite:///{tmp_path / 'central.db'}",
        tmp_path,
        clock,
        read_token=SecretStr(READ),
        admin_token=SecretStr(ADMIN),
    ) as c:
        yield c


@pytest.fixture
def comparisons(monkeypatch: pytest.MonkeyPatch) -> list[tuple[bytes, bytes]]:
    """Every ``hmac.compare_digest(a, b)`` made in this process, as bytes."""
    real = hmac.compare_digest
    seen: list[tuple[bytes, bytes]] = []

    def spy(a: bytes | str, b: bytes | str) -> bool:
        seen.append((_bytes(a), _bytes(b)))
        return real(a, b)  # type: ignore[type-var]

    monkeypatch.setattr(hmac, "compare_digest", spy)
    return seen


def _bytes(value: bytes | str) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


def get(server: Central, path: str, token: str | None) -> int:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.get(f"{server.url}{path}", headers=headers).status_code


def push(server: Central, token: str | None, hostname: str = "host-1") -> int:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    snap = host_snapshot(1, T0, hostname=hostname)
    return httpx.post(
        f"{server.url}/api/v1/snapshots", json=body(snap), headers=headers
    ).status_code


def test_read_and_admin_tokens_are_compared_in_constant_time_both_always(
    server: Central, comparisons: list[tuple[bytes, bytes]]
) -> None:
    assert get(server, "/api/v1/hosts", WRONG) == 403
    assert get(server, "/api/v1/hosts", READ) == 200
    assert get(server, "/api/v1/hosts", ADMIN) == 200  # the admin token reads too

    for given in (WRONG, READ, ADMIN):
        # Against both expected tokens, whichever matched: no early exit to time.
        assert (given.encode(), READ.encode()) in comparisons
        assert (given.encode(), ADMIN.encode()) in comparisons

    comparisons.clear()
    silence = f"{server.url}/api/v1/silences/4242"
    assert httpx.delete(silence, headers={"Authorization": f"Bearer {READ}"}).status_code == 403
    assert httpx.delete(silence, headers={"Authorization": f"Bearer {ADMIN}"}).status_code == 404
    assert (READ.encode(), ADMIN.encode()) in comparisons
    assert (ADMIN.encode(), ADMIN.encode()) in comparisons


def test_an_agent_token_is_only_ever_compared_as_its_digest(
    server: Central, comparisons: list[tuple[bytes, bytes]]
) -> None:
    token = server.token("host-1")
    digest = hashlib.sha256(token.encode()).hexdigest().encode()

    assert push(server, token) == 200

    compared = {side for pair in comparisons for side in pair}
    assert any(digest in side for side in compared)
    assert not any(token.encode() in side for side in compared)


def test_no_token_of_any_kind_is_ever_logged(
    server: Central, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    agent = server.token("host-1")
    server.token("host-2")
    for token in (None, WRONG, READ, ADMIN):
        get(server, "/api/v1/hosts", token)
        get(server, "/metrics", token)
        httpx.delete(
            f"{server.url}/api/v1/silences/1",
            headers={"Authorization": f"Bearer {token}"} if token else {},
        )
    assert push(server, WRONG) == 403
    assert push(server, agent, hostname="host-2") == 403  # another host's name
    assert push(server, agent) == 200

    assert "refused" in caplog.text  # the refusals were logged...
    text = caplog.text + "".join(str(r.args) for r in caplog.records)
    for secret in (agent, WRONG, READ, ADMIN):
        assert secret not in text  # ...never what was presented
