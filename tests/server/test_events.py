"""Events end to end: snapshots in over HTTP, detector findings out as deduplicated events."""

from __future__ import annotations

from typing import Any

import pytest

from gpuwatch.snapshot import MigInstance
from server.factories import GIB, T0, body, gpu, process, snapshot
from server.harness import Live


def events(live: Live, **params: Any) -> list[dict[str, Any]]:
    response = live.client.get("/api/v1/events", params=params)
    assert response.status_code == 200, response.text
    items: list[dict[str, Any]] = response.json()["items"]
    return items


def test_orphaned_process_opens_one_event_that_closes_when_it_exits(live: Live) -> None:
    token = live.token("host-1")
    orphan = process(4242, used_gib=20, orphaned=True, user="carol")
    holding = [snapshot(seq, [gpu(1, [orphan, process(100)])]) for seq in range(3)]

    live.push(token, body(*holding))

    (event,) = events(live, kind="orphaned")
    assert event["open"] is True
    assert (event["reason"], event["pid"], event["user"]) == ("reparented", 4242, "carol")
    assert (event["hostname"], event["gpu_index"]) == ("host-1", 1)
    assert event["held_bytes"] == 20 * GIB
    assert event["started_at"] == holding[0].collected_at
    assert event["last_seen_at"] == holding[-1].collected_at

    gone = snapshot(3, [gpu(1, [process(100)])])
    live.push(token, body(gone))

    (event,) = events(live, kind="orphaned")
    assert event["open"] is False
    assert event["ended_at"] == gone.collected_at


def test_a_changing_reason_stays_one_event(live: Live) -> None:
    token = live.token("host-1")
    reparented = process(7, orphaned=True)
    dead = process(7, orphaned=True, alive=False)

    live.push(token, body(snapshot(0, [gpu(0, [reparented])]), snapshot(1, [gpu(0, [dead])])))

    (event,) = events(live, kind="orphaned")
    assert event["reason"] == "dead_pid"
    assert event["open"] is True


def idle_then_busy(live: Live, token: str) -> tuple[float, float]:
    """A holder idle for 20 min (two requests), then busy for 3 min."""
    idle = [snapshot(seq, [gpu(0, [process(9, used_gib=12, sm=0.0)])]) for seq in range(80)]
    busy = [snapshot(seq, [gpu(0, [process(9, used_gib=12, sm=0.8)])]) for seq in range(80, 92)]
    assert live.push(token, body(*idle[:40])).status_code == 200
    assert live.push(token, body(*idle[40:])).status_code == 200
    assert live.push(token, body(*busy)).status_code == 200
    return idle[0].collected_at, busy[-1].collected_at


def test_idle_holder_opens_an_idle_event_and_activity_closes_it(live: Live) -> None:
    token = live.token("host-1")

    first, last = idle_then_busy(live, token)

    (event,) = events(live, kind="idle")
    assert event["pid"] == 9 and event["held_bytes"] == 12 * GIB
    # Idle for the whole 600 s window, judged on 60 s buckets: stamped with their starts,
    # which may precede the first poll, so by less than one interval early.
    assert first + 600 - 60 < event["started_at"] <= first + 600 + 2 * 60
    assert event["evidence"]["idle_seconds"] >= 600
    assert event["open"] is False and event["ended_at"] <= last


def test_top_idle_ranks_users_by_idle_byte_seconds(live: Live) -> None:
    token = live.token("host-1")
    idle_then_busy(live, token)

    response = live.client.get("/api/v1/events/top-idle", params={"since": T0})

    (row,) = response.json()
    assert row["user"] == "alice" and row["events"] == 1
    assert row["held_byte_seconds"] > 12 * GIB * 500


def test_runaway_share_and_unattributed_memory(live: Live) -> None:
    token = live.token("host-1")
    hog = process(1, used_gib=75, user="dave")
    small = process(2, used_gib=1, user="erin")
    snaps = [
        snapshot(seq, [gpu(0, [hog, small]), gpu(1, [process(3, used_gib=1)], extra_bytes=8 * GIB)])
        for seq in range(2)  # unattributed memory must show twice in a row
    ]

    live.push(token, body(*snaps))

    (runaway,) = events(live, kind="runaway")
    assert (runaway["reason"], runaway["pid"], runaway["user"]) == ("share", 1, "dave")
    (unattributed,) = events(live, kind="orphaned")
    assert unattributed["reason"] == "unattributed"
    assert (unattributed["gpu_index"], unattributed["pid"]) == (1, None)
    assert unattributed["held_bytes"] == 8 * GIB


def test_leak_is_detected_over_the_leak_window(live: Live) -> None:
    token = live.token("host-1")
    # +6 MiB per 15 s poll for 40 min (400 KiB/s, above the 64 KiB/s threshold).
    snaps = [
        snapshot(seq, [gpu(0, [process(5, used_gib=2 + seq * 6 / 1024), process(6)])])
        for seq in range(160)
    ]

    live.push(token, body(*snaps))

    (leak,) = [e for e in events(live, kind="runaway") if e["reason"] == "leak"]
    assert leak["pid"] == 5 and leak["open"] is True
    assert leak["evidence"]["slope_bytes_per_second"] == pytest.approx(6 * 2**20 / 15, rel=0.2)


def test_a_leak_in_a_mig_instance_is_full_when_its_instance_is(live: Live) -> None:
    """100 MiB/min inside a 10 GiB instance of an 80 GiB board: the instance is what
    fills (before, the time to full was the whole board's free memory over the slope)."""
    token = live.token("host-1")
    snaps = []
    for seq in range(160):
        used = 2 + seq * 25 / 1024  # GiB: +25 MiB a 15 s poll
        leaking = process(5, used_gib=used, gpu_instance_id=7)
        mig = MigInstance(
            index=0,
            uuid="MIG-aaaaaaaa-0000-0000-0000-000000000000",
            gpu_instance_id=7,
            profile="1g.10gb",
            memory_total_bytes=10 * GIB,
            memory_used_bytes=int(used * GIB),
        )
        snaps.append(snapshot(seq, [gpu(0, [leaking], mig_instances=[mig])]))
    live.push(token, body(*snaps))
    (leak,) = [e for e in events(live, kind="runaway") if e["reason"] == "leak"]
    free = 10 * GIB - int((2 + 159 * 25 / 1024) * GIB)
    slope = leak["evidence"]["slope_bytes_per_second"]
    assert leak["evidence"]["gpu_total_bytes"] == 10 * GIB
    assert leak["evidence"]["time_to_exhaust_seconds"] == pytest.approx(free / slope, rel=0.05)
    assert leak["evidence"]["time_to_exhaust_seconds"] < 3600  # the board: 12 h


def test_lost_gpu_opens_gpu_lost_and_its_return_records_gpu_back(live: Live) -> None:
    token = live.token("host-1")
    ok = gpu(3, [process(1)])
    lost = gpu(
        3, lost=True, memory_used_bytes=None, memory_free_bytes=None, unattributed_bytes=None
    )

    live.push(token, body(snapshot(0, [ok]), snapshot(1, [lost]), snapshot(2, [lost])))
    (open_lost,) = events(live, kind="gpu_lost", open="true")
    assert open_lost["gpu_index"] == 3
    # The GPU said nothing about its processes while lost: the lifetime is still open.
    assert live.client.get("/api/v1/processes", params={"open": "true"}).json()["items"]

    live.push(token, body(snapshot(3, [ok])))
    assert events(live, kind="gpu_lost", open="true") == []
    (back,) = events(live, kind="gpu_back")
    assert back["started_at"] == back["ended_at"] == T0 + 3 * 15


def test_a_lost_gpu_the_agent_could_not_name_is_the_gpu_it_had_at_that_index(
    live: Live,
) -> None:
    """An agent restarted after a GPU fell off the bus never read its UUID and sends
    ``GPU-unknown-3``: that is the board the host had at index 3, not a new GPU."""
    token = live.token("host-1")
    ok = gpu(3, [process(1)])
    lost = gpu(
        3,
        uuid="GPU-unknown-3",
        name=None,
        lost=True,
        memory_used_bytes=None,
        memory_free_bytes=None,
        unattributed_bytes=None,
    )
    live.push(token, body(snapshot(0, [ok]), snapshot(1, [lost])))
    host = live.client.get("/api/v1/hosts/host-1").json()
    assert [(g["uuid"], g["name"], g["lost"]) for g in host["gpus"]] == [(ok.uuid, ok.name, True)]
    (open_lost,) = events(live, kind="gpu_lost", open="true")
    assert ok.uuid in open_lost["summary"]


def test_event_filters(live: Live) -> None:
    token1, token2 = live.token("host-1"), live.token("host-2")
    live.push(token1, body(snapshot(0, [gpu(0, [process(1, orphaned=True, user="ann")])])))
    live.push(
        token2,
        body(
            snapshot(
                0,
                [gpu(2, [process(2, orphaned=True, user="bob"), process(3, used_gib=75)])],
                hostname="host-2",
                at=T0 + 1000,
            )
        ),
    )

    assert {e["hostname"] for e in events(live)} == {"host-1", "host-2"}
    assert [e["user"] for e in events(live, host="host-2", kind="orphaned")] == ["bob"]
    assert [e["pid"] for e in events(live, gpu=2, kind="runaway")] == [3]
    assert [e["user"] for e in events(live, user="ann")] == ["ann"]
    assert [e["hostname"] for e in events(live, until=T0 + 500)] == ["host-1"]
    assert {e["hostname"] for e in events(live, since=T0 + 500)} == {"host-1", "host-2"}
    assert events(live, open="true", kind="idle") == []
    assert live.client.get("/api/v1/events", params={"kind": "nonsense"}).status_code == 422


def test_event_pages_follow_the_cursor(live: Live) -> None:
    token = live.token("host-1")
    # Five short-lived orphans, one after the other: five events.
    snaps = [snapshot(seq, [gpu(0, [process(seq + 1, orphaned=True)])]) for seq in range(5)]
    live.push(token, body(*snaps))

    seen: list[int] = []
    params: dict[str, Any] = {"limit": 2}
    while True:
        page = live.client.get("/api/v1/events", params=params).json()
        seen += [e["pid"] for e in page["items"]]
        if page["next_cursor"] is None:
            break
        params["cursor"] = page["next_cursor"]
    assert seen == [5, 4, 3, 2, 1]
    assert live.client.get("/api/v1/events", params={"cursor": "bogus"}).status_code == 422


def test_reported_events_are_stored_once(live: Live) -> None:
    token = live.token("host-1")
    oom = {
        "kind": "oom",
        "hostname": "host-1",
        "gpu_index": 0,
        "pid": 77,
        "user": "fay",
        "held_bytes": 3 * GIB,
        "summary": "CUDA out of memory in train.py",
        "evidence": {"explain": {"tried_bytes": 2 * GIB}, "snapshot": {"gpus": []}},
        "occurred_at": T0 + 5,
    }
    headers = {"Authorization": f"Bearer {token}"}

    first = live.client.post("/api/v1/events", json=oom, headers=headers)
    retry = live.client.post("/api/v1/events", json=oom, headers=headers)
    other_host = live.client.post("/api/v1/events", json=oom | {"hostname": "x"}, headers=headers)

    assert first.status_code == 200 and first.json()["duplicate"] is False
    assert retry.status_code == 200 and retry.json()["duplicate"] is True
    assert other_host.status_code == 403
    (event,) = events(live, kind="oom")
    assert event["evidence"]["explain"] == {"tried_bytes": 2 * GIB}
    assert event["started_at"] == event["ended_at"] == T0 + 5


def test_fleet_summary(live: Live) -> None:
    token1, token2 = live.token("host-1"), live.token("host-2")
    live.token("host-never-reported")
    live.clock.now = T0 + 20 * 15
    idle_then_busy(live, token1)
    live.push(
        token2,
        body(
            snapshot(
                0,
                [
                    gpu(0, [process(1, used_gib=75)]),
                    gpu(1, [process(2, used_gib=30, orphaned=True)]),
                ],
                hostname="host-2",
            )
        ),
    )

    fleet = live.client.get("/api/v1/fleet").json()

    assert fleet["hosts"] == 3 and fleet["gpus"] == 3
    assert fleet["gpus_by_fullness"]["90-100%"] == 1  # 75 of 80 GiB
    assert fleet["gpus_by_fullness"]["25-50%"] == 1  # 30 of 80 GiB
    assert fleet["gpus_by_fullness"]["0-25%"] == 1  # host-1's 12 GiB
    assert fleet["orphaned_bytes"] == 30 * GIB
    assert fleet["idle_bytes"] == 0  # host-1's holder became busy again
    assert fleet["silent_hosts"] == ["host-never-reported"]
