"""A renamed host, end to end: the real server's refusal and the agent's reporter.

The server refuses (403) a batch holding a snapshot its token's host did not take, with
a ``detail`` the agent recognises (:data:`~gpuwatch.agent.reporter.OTHER_HOST_DETAIL`):
these tests hold the two sides to the same words. The agent drops what it spooled
under its old name (counted, and reported to the server) instead of being refused for
days behind it, and when its token is the old name's, its log says what to do.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from pydantic import SecretStr

from gpuwatch.agent.reporter import Reporter
from gpuwatch.settings import AgentSettings
from gpuwatch.snapshot import HostSnapshot
from gpuwatch.wire import OTHER_HOST_DETAIL
from server.factories import gpu, process, snapshot
from server.harness import Live


def renamed(sequence: int, hostname: str, live: Live) -> HostSnapshot:
    """A snapshot of the one machine (one agent id) under ``hostname``."""
    taken = snapshot(sequence, [gpu(0, [process(100)])], hostname=hostname)
    live.clock.now = max(live.clock.now, taken.collected_at)
    return taken.model_copy(update={"agent_id": "agent-1"})


def reporter(url: str, token: str, spool_dir: Path) -> Reporter:
    settings = AgentSettings(server_url=url, token=SecretStr(token), spool_dir=spool_dir)
    return Reporter(settings)


def test_the_servers_other_host_refusal_is_the_one_the_agent_recognises(live: Live) -> None:
    token = live.token("oldname")
    body = {"snapshots": [renamed(1, "newname", live).model_dump(mode="json")]}

    refused = live.push(token, body)

    assert refused.status_code == 403
    assert refused.json() == {"detail": OTHER_HOST_DETAIL + "oldname"}


def test_a_renamed_host_drops_its_old_names_spool_and_its_pushes_go_through(
    live: Live, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    spool_dir = tmp_path / "spool"
    # Before the rename, with the server away: three snapshots wait in the spool.
    before = reporter("http://127.0.0.1:9", "gwt_x", spool_dir)
    try:
        for sequence in range(3):
            before.offer(renamed(sequence, "oldname", live))
    finally:
        before.close()
    caplog.set_level(logging.INFO, logger="gpuwatch")

    after = reporter(live.url, live.token("newname"), spool_dir)
    try:
        after.offer(renamed(10, "newname", live))
        result = after.drain_once()
        stats = after.stats()
    finally:
        after.close()

    assert (result.stopped_by, result.delivered, result.dropped) == (None, 1, 3)
    assert stats.dropped_total == {"hostname_changed": 3}
    host = live.client.get("/api/v1/hosts/newname").json()
    assert host["spool_dropped_total"] == 3 and host["last_seen_at"] is not None
    assert live.client.get("/api/v1/hosts/oldname").status_code == 404
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_a_renamed_host_with_its_old_token_is_told_how_to_fix_it(
    live: Live, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="gpuwatch")
    pusher = reporter(live.url, live.token("oldname"), tmp_path / "spool")
    try:
        pusher.offer(renamed(1, "newname", live))
        result = pusher.drain_once()
        stats = pusher.stats()
    finally:
        pusher.close()

    assert result.stopped_by == "auth_failed" and stats.pending == 1
    assert stats.dropped_total == {}
    (error,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert "(HTTP 403: this token belongs to host oldname)" in error
    assert "gpuwatch token create newname" in error
    assert 'hostname = "oldname"' in error
