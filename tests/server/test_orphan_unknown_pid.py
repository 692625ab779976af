"""A snapshot where a dead PID is merely not visible leaves its orphaned event open.

An agent confirms a PID missing from ``/proc`` dead only at its second poll in a row, so
the first snapshot after an agent restart lists a known dead PID as alive and not
visible (unknown). That closed the dead-PID event, and the next snapshot opened a new
one: its "since" lost, the fleet's orphaned memory dipped, and every wait on it
(alert rules' ``held_for``, Prometheus ``for:``) started over.
"""

from __future__ import annotations

from typing import Any

from server.factories import GIB, body, gpu, process, snapshot
from server.harness import Live


def _events(live: Live, **params: Any) -> list[dict[str, Any]]:
    response = live.client.get("/api/v1/events", params=params)
    assert response.status_code == 200, response.text
    items: list[dict[str, Any]] = response.json()["items"]
    return items


def _push(live: Live, token: str, *snaps: Any) -> None:
    response = live.push(token, body(*snaps))
    assert response.status_code == 200, response.text


def _ghost(**fields: Any) -> Any:
    # Never seen alive: no start time, no owner (the workstation scenario's PID 4100001).
    return process(4100001, used_gib=6, sm=0.0, start_time=None, **fields).model_copy(
        update={"start_time": None}
    )


DEAD = {"alive": False}
UNKNOWN = {"alive": True, "visible": False}


def test_an_agent_restart_does_not_split_the_dead_pids_event(live: Live) -> None:
    token = live.token("host-1")
    dead = [snapshot(seq, [gpu(0, [_ghost(**DEAD)])]) for seq in range(4)]
    _push(live, token, *dead)
    (opened,) = _events(live, open="true")
    assert (opened["kind"], opened["reason"]) == ("orphaned", "dead_pid")

    # The agent restarts: its first poll cannot yet confirm the PID is gone.
    _push(live, token, snapshot(4, [gpu(0, [_ghost(**UNKNOWN)])]))
    assert live.client.get("/api/v1/fleet").json()["orphaned_bytes"] == 6 * GIB
    _push(live, token, *[snapshot(seq, [gpu(0, [_ghost(**DEAD)])]) for seq in range(5, 8)])

    (event,) = _events(live)  # one event, still open, since the first snapshot
    assert event["id"] == opened["id"] and event["ended_at"] is None
    assert event["started_at"] == dead[0].collected_at
    assert live.client.get("/api/v1/fleet").json()["orphaned_bytes"] == 6 * GIB


def test_a_pid_not_visible_opens_nothing_and_a_pid_gone_from_the_list_ends_it(
    live: Live,
) -> None:
    token = live.token("host-1")
    _push(live, token, *[snapshot(seq, [gpu(0, [_ghost(**UNKNOWN)])]) for seq in range(3)])
    assert _events(live) == []  # not visible proves nothing: no verdict

    _push(live, token, snapshot(3, [gpu(0, [_ghost(**DEAD)])]))
    _push(live, token, snapshot(4, [gpu(0, [_ghost(**UNKNOWN)])]))
    _push(live, token, snapshot(5, [gpu(0, [])]))  # the context is freed at last
    (event,) = _events(live)
    assert event["kind"] == "orphaned" and event["ended_at"] is not None
