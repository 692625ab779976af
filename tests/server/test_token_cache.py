"""The ingest path's cache of verified tokens: revocation stays immediate.

Ingest skips the read session that checks a token it has verified before, and
confirms it in the transaction that stores the push instead, so a revoked token is
refused by the very next request, on every replica, with nothing stored.
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any

import httpx
from fastapi import FastAPI
from sqlalchemy import func, select

from gpuwatch.server.app import create_app
from gpuwatch.server.auth import service as auth_service
from gpuwatch.server.auth.cache import VerifiedTokens
from gpuwatch.server.auth.service import AgentIdentity, hash_token
from gpuwatch.server.database import Database
from gpuwatch.server.ingest.models import SnapshotSeen
from gpuwatch.settings import ServerSettings
from server.factories import body, gpu, process, snapshot
from server.harness import FakeClock, Live, serve


def small(sequence: int, hostname: str = "host-1") -> dict[str, Any]:
    return body(snapshot(sequence, [gpu(0, [process(100)])], hostname=hostname))


def revoke(database: Database, hostname: str, now: float) -> None:
    """What ``gpuwatch token revoke`` does, from outside the server process."""
    with database.writer() as session, session.begin():
        assert auth_service.revoke_tokens(session=session, hostname=hostname, now=now) == 1


def stored(database: Database) -> int:
    with database.reader() as session:
        return session.scalar(select(func.count()).select_from(SnapshotSeen)) or 0


def test_a_revoked_token_is_refused_by_the_next_push_though_cached(
    app: FastAPI, live: Live
) -> None:
    token = live.token("host-1")
    assert live.push(token, small(0)).status_code == 200
    tokens = app.state.gpuwatch.tokens
    assert hash_token(token) in tokens  # the next push skips the read session

    revoke(live.database, "host-1", live.clock())
    refused = live.push(token, small(1))

    assert refused.status_code == 403
    assert refused.json() == {"detail": "unknown or revoked token"}
    assert stored(live.database) == 1  # nothing of the refused push
    assert hash_token(token) not in tokens
    assert live.push(token, small(2)).status_code == 403  # now refused before any write


def test_revocation_is_immediate_on_every_replica(
    settings: ServerSettings, database: Database, clock: FakeClock
) -> None:
    replicas = [create_app(settings, clock=clock, engine=database.engine) for _ in range(2)]
    with ExitStack() as stack:
        live = []
        for app in replicas:
            url = stack.enter_context(serve(app))
            client = stack.enter_context(httpx.Client(base_url=url, timeout=10))
            live.append(Live(url=url, client=client, database=database, clock=clock))
        token = live[0].token("host-1")
        for sequence, replica in enumerate(live):
            assert replica.push(token, small(sequence)).status_code == 200
        assert all(hash_token(token) in app.state.gpuwatch.tokens for app in replicas)

        revoke(database, "host-1", clock())

        for sequence, replica in enumerate(live, start=2):
            assert replica.push(token, small(sequence)).status_code == 403
        assert stored(database) == 2


def test_a_cached_revoked_token_with_a_bad_body_is_refused_not_rejected(live: Live) -> None:
    # 422 would make the agent drop the snapshot; 403 keeps it spooled until the
    # operator deploys a new token, as for a token that was never cached.
    token = live.token("host-1")
    assert live.push(token, small(0)).status_code == 200
    bad = small(1)
    bad["snapshots"][0]["sequence"] = -1
    assert live.push(token, bad).status_code == 422  # while the token is good
    revoke(live.database, "host-1", live.clock())

    response = live.push(token, bad)

    assert response.status_code == 403
    assert response.json() == {"detail": "unknown or revoked token"}


def test_a_token_created_after_a_refusal_works_at_once(live: Live) -> None:
    old = live.token("host-1")
    assert live.push(old, small(0)).status_code == 200
    revoke(live.database, "host-1", live.clock())
    assert live.push(old, small(1)).status_code == 403

    new = live.token("host-1")  # the rotation: refusals are never cached

    assert live.push(new, small(1)).status_code == 200
    assert live.push(old, small(2)).status_code == 403


def test_the_cache_forgets_the_least_recently_used_past_its_bound() -> None:
    tokens = VerifiedTokens(max_entries=2)
    a, b, c = (AgentIdentity(host_id=i, hostname=f"host-{i}") for i in range(3))
    tokens.add("a", a)
    tokens.add("b", b)
    assert tokens.get("a") == a  # now the most recently used
    tokens.add("c", c)

    assert len(tokens) == 2
    assert "b" not in tokens
    assert tokens.get("a") == a and tokens.get("c") == c
    tokens.discard("a")
    tokens.discard("a")  # forgetting twice is harmless
    assert tokens.get("a") is None and len(tokens) == 1
