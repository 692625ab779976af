"""An agent whose clock steps back (an NTP correction, a VM restore) keeps having its
snapshots applied: the same boot and a higher sequence than the last applied one is
newer by definition. They are applied at the server's receive time, so the host's
state never moves backwards; a retry or a replay (same or lower sequence) is still
answered ``duplicate`` / ``late``."""

from __future__ import annotations

import logging

import pytest

from server.factories import GIB, T0, body, gpu, process, snapshot
from server.harness import Live

STEP = 3600.0


def post(live: Live, token: str, *snaps: object) -> list[str]:
    # Not live.push: that would move the server clock to the agent's (stepped) time.
    response = live.client.post(
        "/api/v1/snapshots", json=body(*snaps), headers={"Authorization": f"Bearer {token}"}
    )
    assert response.status_code == 200, response.text
    results: list[str] = response.json()["results"]
    return results


def host(live: Live) -> dict[str, object]:
    found: dict[str, object] = live.client.get("/api/v1/hosts/host-1").json()
    return found


def test_snapshots_after_a_backward_clock_step_are_applied(
    live: Live, caplog: pytest.LogCaptureFixture
) -> None:
    token = live.token("host-1")
    live.clock.now = T0
    for seq in range(1, 4):
        live.clock.advance(15)
        assert post(live, token, snapshot(seq, [gpu(0, [process(100)])], at=live.clock())) == [
            "accepted"
        ]
    before = host(live)["last_seen_at"]

    caplog.set_level(logging.WARNING, logger="gpuwatch.server.ingest.service")
    for seq in range(4, 8):  # the agent's clock is now an hour behind
        live.clock.advance(15)
        stepped = snapshot(seq, [gpu(0, [process(100, used_gib=seq)])], at=live.clock() - STEP)
        assert post(live, token, stepped) == ["accepted"]
        # Applied at the server's receive time: state follows, and never goes back.
        assert host(live)["last_seen_at"] == live.clock()

    state = host(live)
    assert state["last_seen_at"] > before  # type: ignore[operator]
    processes = state["gpus"][0]["processes"]  # type: ignore[index]
    assert [p["current_bytes"] for p in processes] == [7 * GIB]
    assert "clock stepped back" in caplog.text
    # Counted, so an operator can alert on a host whose time sync is broken.
    scrape = live.client.get("/metrics").text
    assert "gpuwatch_server_clock_stepped_snapshots_total 4.0" in scrape


def test_a_process_gone_after_the_step_ends_its_lifetime(live: Live) -> None:
    token = live.token("host-1")
    live.clock.now = T0 + 15
    post(live, token, snapshot(1, [gpu(0, [process(100)])], at=live.clock()))
    live.clock.advance(15)

    assert post(live, token, snapshot(2, [gpu(0, [])], at=live.clock() - STEP)) == ["accepted"]

    assert host(live)["gpus"][0]["processes"] == []  # type: ignore[index]


def test_several_stepped_snapshots_in_one_request_are_all_applied_in_order(live: Live) -> None:
    token = live.token("host-1")
    live.clock.now = T0 + 15
    post(live, token, snapshot(1, [gpu(0, [process(100)])], at=live.clock()))
    live.clock.advance(60)
    drained = [
        snapshot(seq, [gpu(0, [process(100, used_gib=seq)])], at=live.clock() - STEP + seq)
        for seq in range(2, 5)
    ]

    assert post(live, token, *drained) == ["accepted"] * 3

    state = host(live)
    assert [p["current_bytes"] for p in state["gpus"][0]["processes"]] == [4 * GIB]  # type: ignore[index]
    assert state["last_seen_at"] > live.clock()  # type: ignore[operator]


def test_replays_and_retries_are_still_late_or_duplicate(live: Live) -> None:
    token = live.token("host-1")
    live.clock.now = T0 + 150
    newest = snapshot(10, [gpu(0, [process(100)])], at=live.clock())
    post(live, token, newest)

    # A lower sequence of the same boot: a spool replay, whatever its time says.
    assert post(live, token, snapshot(3, [gpu(0)], at=live.clock() - STEP)) == ["late"]
    assert post(live, token, newest) == ["duplicate"]
    # Another agent id or boot id is no proof of order: still judged by time.
    other = snapshot(11, [gpu(0)], at=live.clock() - STEP, hostname="host-1")
    other = other.model_copy(update={"agent_id": "someone-else"})
    assert post(live, token, other) == ["late"]
    assert host(live)["gpus"][0]["processes"] != []  # type: ignore[index]
