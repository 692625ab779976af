"""Retiring a host (``gpuwatch token revoke --retire``) and revoking its tokens, against
pushes in flight; and what the fleet and the host's page show of a retired host.

On Postgres a push read its token with a plain SELECT (READ COMMITTED), then queued on
the host row's lock that the retire held, and was stored once the retire committed:
events and lifetimes reopened on a retired host. On SQLite BEGIN IMMEDIATE serialises
the two. Both dialects must refuse the push (403) once the revoke has committed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import httpx
import pytest
from sqlalchemy import text, update
from sqlalchemy.orm import Session

from gpuwatch.server.auth.service import revoke_tokens
from gpuwatch.server.events.models import Event
from gpuwatch.server.hosts.models import Host
from gpuwatch.server.hosts.retire import retire_host
from server.factories import GIB, body, gpu, process, snapshot
from server.harness import Live


def _in_flight(live: Live, session: Session) -> Callable[[], bool]:
    """Whether a push is waiting on what ``session``'s open write transaction holds: a
    row lock on Postgres, this process's write turn on SQLite."""
    database = live.database
    if database.dialect == "sqlite":
        turns = database.write_turns
        assert turns is not None
        return lambda: turns.waiting > 0
    pid = session.execute(text("SELECT pg_backend_pid()")).scalar_one()
    with database.engine.connect() as conn:
        conn.execute(text("SELECT 1"))  # open the watcher's connection up front

    def blocked() -> bool:
        with database.engine.connect() as conn:
            query = "SELECT count(*) FROM pg_stat_activity WHERE :pid = ANY(pg_blocking_pids(pid))"
            return bool(conn.execute(text(query), {"pid": pid}).scalar_one())

    return blocked


def _wait_for(condition: Callable[[], bool], done: Future[httpx.Response]) -> bool:
    """Poll an outside condition (another session's lock wait) until it holds or the
    push has finished without waiting; True when it held."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if condition():
            return True
        if done.done():
            return False
        time.sleep(0.01)
    raise AssertionError("the push neither waited nor finished")


@pytest.mark.parametrize("retire", [True, False], ids=["retire", "revoke"])
def test_a_push_in_flight_during_a_revoke_is_refused_once_it_commits(
    live: Live, retire: bool
) -> None:
    token = live.token("gpu-old")
    first = snapshot(0, [gpu(0, [process(41, orphaned=True)])], hostname="gpu-old")
    assert live.push(token, body(first)).status_code == 200
    # A lost GPU opens gpu_lost, which nothing would close on a retired host.
    late = snapshot(
        1, [gpu(0, [process(41, orphaned=True)]), gpu(1, lost=True)], hostname="gpu-old"
    )
    database = live.database

    with ThreadPoolExecutor(1) as pool:
        with database.writer() as session:  # SQLite: the turn is held until it closes
            blocked = _in_flight(live, session)
            if retire:
                done = retire_host(
                    session=session, dialect=database.dialect, hostname="gpu-old", now=live.clock()
                )
                assert done is not None and done.tokens == 1
            else:
                assert revoke_tokens(session=session, hostname="gpu-old", now=live.clock()) == 1
            pushed = pool.submit(live.push, token, body(late))
            waited = _wait_for(blocked, pushed)
            session.commit()
        answer = pushed.result(timeout=30)

    assert answer.status_code == 403, answer.text
    assert waited  # it was in flight, not answered before the revoke
    events = live.client.get("/api/v1/events", params={"host": "gpu-old", "open": True}).json()
    if retire:
        assert events["items"] == []
        processes = live.client.get("/api/v1/processes", params={"host": "gpu-old"}).json()
        assert [p for p in processes["items"] if p["ended_at"] is None] == []
    assert "gpu_lost" not in {e["kind"] for e in events["items"]}
    # And the token is refused from now on, cached or not.
    again = snapshot(2, [gpu(0)], hostname="gpu-old")
    assert live.push(token, body(again)).status_code == 403


def test_retiring_again_keeps_the_first_retirement_time(live: Live) -> None:
    live.token("gpu-old")
    first, later = live.clock() + 10, live.clock() + 500
    for now in (first, later):
        with live.database.writer() as session:
            assert retire_host(
                session=session, dialect=live.database.dialect, hostname="gpu-old", now=now
            )
            session.commit()
    (host,) = live.client.get("/api/v1/hosts").json()
    assert host["retired_at"] == first


def test_the_fleet_summary_leaves_retired_hosts_out(live: Live) -> None:
    """Whatever a retired host still has open (left by a push that raced its retire
    before this was fixed) counts nowhere in the fleet's figures."""
    held = [process(41, orphaned=True, used_gib=12, sm=0.0)]
    for name in ("gpu-old", "gpu-new"):
        one = snapshot(0, [gpu(0, held)], hostname=name)
        assert live.push(live.token(name), body(one)).status_code == 200
    with live.database.writer() as session:
        ids = {name: id_ for name, id_ in session.execute(text("SELECT hostname, id FROM hosts"))}
        for name, size in (("gpu-old", 30), ("gpu-new", 20)):
            session.add(
                Event(
                    kind="idle",
                    reason="idle",
                    host_id=ids[name],
                    dedup_key=f"idle-{name}",
                    held_bytes=size * GIB,
                    summary="idle",
                    evidence={},
                    started_at=live.clock(),
                    last_seen_at=live.clock(),
                )
            )
        session.execute(update(Host).where(Host.hostname == "gpu-old").values(retired_at=1.0))
        session.commit()

    fleet = live.client.get("/api/v1/fleet").json()
    assert fleet["hosts"] == 1
    assert fleet["orphaned_bytes"] == 12 * GIB
    assert fleet["idle_bytes"] == 20 * GIB
    assert [e["hostname"] for e in fleet["top_idle"]] == ["gpu-new"]


def test_the_page_of_a_retired_host_says_so_and_shows_its_figures_as_stale(live: Live) -> None:
    token = live.token("gpu-old")
    one = snapshot(0, [gpu(0, [process(41)])], hostname="gpu-old")
    assert live.push(token, body(one)).status_code == 200
    live.clock.now += 120
    with live.database.writer() as session:
        retire_host(
            session=session, dialect=live.database.dialect, hostname="gpu-old", now=live.clock()
        )
        session.commit()
    live.clock.now += 3600

    for url in ("/hosts/gpu-old", "/hosts/gpu-old/gpus/0"):
        page = live.client.get(url)
        assert page.status_code == 200
        html = page.text
        h1 = html[html.index("<h1>") : html.index("</h1>")]
        assert '<span class="badge silent retired"' in h1 and "retired 1 h ago" in h1
        assert "Retired 2027-01-15" in html and "no longer watched" in html
        assert "no current reading: host retired" in html
        assert "Processes at the last report" in html
        assert "Processes holding memory now" not in html
        assert '<span class="badge silent">silent</span>' not in html
