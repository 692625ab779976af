"""A server whose clock is behind (a restored VM, broken NTP) refuses every host's
snapshots as from its future: the answer names both clocks, and once several hosts
look ahead at once the server logs an ERROR that suspects its own clock and counts
them. Also: two agents alternating under one host name are counted and logged.

The agent's side (keeping such snapshots spooled) is tests/agent/test_spool_audit.py."""

from __future__ import annotations

import logging

import pytest

from gpuwatch.snapshot import HostSnapshot
from server.factories import T0, body, gpu, snapshot
from server.harness import Live

HOUR = 3600.0


def post(live: Live, token: str, *snaps: HostSnapshot) -> tuple[int, object]:
    # Not live.push: that would move the server's clock up to the snapshots'.
    response = live.client.post(
        "/api/v1/snapshots", json=body(*snaps), headers={"Authorization": f"Bearer {token}"}
    )
    return response.status_code, response.json()


def scrape(live: Live) -> str:
    return live.client.get("/metrics").text


def test_many_hosts_from_the_future_make_the_server_suspect_its_own_clock(
    live: Live, caplog: pytest.LogCaptureFixture
) -> None:
    live.clock.now = T0
    caplog.set_level(logging.WARNING, logger="gpuwatch.server.ingest.writer")
    # The server's clock runs 2 h behind every agent's.
    for n in range(1, 5):
        token = live.token(f"host-{n}")
        status, answer = post(
            live, token, snapshot(1, [gpu(0)], hostname=f"host-{n}", at=T0 + 2 * HOUR)
        )
        assert status == 422
        (problem,) = answer["detail"]  # type: ignore[index]
        assert (problem["type"], problem["loc"]) == ("clock_skew", ["body", "snapshots", 0])
        assert "agent's clock runs ahead, or the server's runs behind" in problem["msg"]

    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1  # once per window, not once per push
    assert "this server's clock is probably behind" in errors[0]
    metrics = scrape(live)
    assert "gpuwatch_server_future_snapshot_pushes_total 4.0" in metrics
    assert "gpuwatch_server_hosts_ahead_of_clock 4.0" in metrics
    # Ten minutes on, the hosts no longer count as ahead.
    live.clock.now = T0 + 601
    assert "gpuwatch_server_hosts_ahead_of_clock 0.0" in scrape(live)


def test_one_host_ahead_is_that_hosts_fault_and_never_pins_its_time(
    live: Live, caplog: pytest.LogCaptureFixture
) -> None:
    live.clock.now = T0
    token = live.token("host-1")
    caplog.set_level(logging.WARNING, logger="gpuwatch.server.ingest.writer")
    status, _ = post(live, token, snapshot(1, [gpu(0)], at=T0 + 2 * HOUR))
    assert status == 422
    assert not [r for r in caplog.records if r.levelno == logging.ERROR]
    assert "host-1" in caplog.text
    # Nothing of it was stored: an honest snapshot after it is applied.
    live.clock.advance(15)
    status, answer = post(live, token, snapshot(2, [gpu(0)], at=live.clock()))
    assert status == 200 and answer["results"] == ["accepted"]  # type: ignore[index]


def test_two_agents_alternating_under_one_host_name_are_counted(
    live: Live, caplog: pytest.LogCaptureFixture
) -> None:
    live.clock.now = T0
    token = live.token("host-1")
    caplog.set_level(logging.WARNING, logger="gpuwatch.server.ingest.writer")
    for seq in range(1, 7):
        live.clock.advance(15)
        snap = snapshot(seq, [gpu(0)], at=live.clock())
        agent = "agent-a" if seq % 2 else "agent-b"
        status, _ = post(live, token, snap.model_copy(update={"agent_id": agent}))
        assert status == 200
    # a, b (a new agent: not a flap), a, b, a, b: four switches back.
    assert "gpuwatch_server_agent_id_flaps_total 4.0" in scrape(live)
    assert "pushes alternate between two agent_ids" in caplog.text


def test_a_replaced_agent_is_not_a_flap(live: Live) -> None:
    live.clock.now = T0
    token = live.token("host-1")
    for seq, agent in enumerate(["agent-a", "agent-a", "agent-b", "agent-b"], start=1):
        live.clock.advance(15)
        snap = snapshot(seq, [gpu(0)], at=live.clock()).model_copy(update={"agent_id": agent})
        assert post(live, token, snap)[0] == 200
    assert "gpuwatch_server_agent_id_flaps_total 0.0" in scrape(live)
