"""Detection you can act on, end to end over real HTTP: verdict precedence, bytes counted
once in the fleet, the event outbox, and signals that must raise nothing."""

from __future__ import annotations

from typing import Any

from sqlalchemy import func, select

from gpuwatch.server.events.models import Event
from gpuwatch.server.events.outbox import OutboxRow
from gpuwatch.server.jobs import detect_silent_agents
from gpuwatch.settings import ServerSettings
from server.factories import GIB, T0, body, gpu, process, snapshot
from server.harness import Live


def events(live: Live, **params: Any) -> list[dict[str, Any]]:
    response = live.client.get("/api/v1/events", params=params)
    assert response.status_code == 200, response.text
    items: list[dict[str, Any]] = response.json()["items"]
    return items


def outbox(live: Live) -> list[tuple[int, str, str, str]]:
    """(event id, change, kind, reason) of every outbox row, in insertion order."""
    with live.database.reader() as session:
        rows = session.execute(
            select(OutboxRow.event_id, OutboxRow.change, OutboxRow.kind, OutboxRow.reason).order_by(
                OutboxRow.id
            )
        ).all()
    return [tuple(row) for row in rows]  # type: ignore[misc]


def push_all(live: Live, token: str, snaps: list[Any], batch: int = 100) -> None:
    for i in range(0, len(snaps), batch):
        response = live.push(token, body(*snaps[i : i + batch]))
        assert response.status_code == 200, response.text


def test_a_dead_pid_is_one_orphaned_event_and_its_bytes_count_once(live: Live) -> None:
    token = live.token("host-1")
    # Dead, holding 12 GiB, no SM activity, for 30 min: idle by every measure, but a
    # dead PID is orphaned, and only orphaned.
    ghost = process(4100, used_gib=12, sm=0.0, alive=False, orphaned=True)
    push_all(live, token, [snapshot(seq, [gpu(0, [ghost, process(7)])]) for seq in range(120)])

    (event,) = events(live)
    assert (event["kind"], event["reason"], event["pid"]) == ("orphaned", "dead_pid", 4100)
    fleet = live.client.get("/api/v1/fleet").json()
    assert fleet["orphaned_bytes"] == 12 * GIB
    assert fleet["idle_bytes"] == 0


def test_an_idle_holder_that_becomes_orphaned_leaves_idle_at_once(live: Live) -> None:
    token = live.token("host-1")
    idle = [snapshot(seq, [gpu(0, [process(9, used_gib=10, sm=0.0)])]) for seq in range(60)]
    push_all(live, token, idle)
    assert [e["kind"] for e in events(live, open="true")] == ["idle"]

    # Its parent shell dies: reparented. The next snapshot, not the next bucket, moves it.
    orphan = snapshot(60, [gpu(0, [process(9, used_gib=10, sm=0.0, orphaned=True)])])
    push_all(live, token, [orphan])

    (now_open,) = events(live, open="true")
    assert (now_open["kind"], now_open["reason"]) == ("orphaned", "reparented")
    (ended,) = events(live, open="false")
    assert ended["kind"] == "idle" and ended["ended_at"] == orphan.collected_at
    fleet = live.client.get("/api/v1/fleet").json()
    assert (fleet["orphaned_bytes"], fleet["idle_bytes"]) == (10 * GIB, 0)


def test_unattributed_memory_needs_two_consecutive_snapshots(live: Live) -> None:
    token = live.token("host-1")
    clean = gpu(0, [process(1)])
    dirty = gpu(0, [process(1)], extra_bytes=8 * GIB)
    # One snapshot taken while a big free raced the process list: no event.
    push_all(live, token, [snapshot(0, [clean]), snapshot(1, [dirty]), snapshot(2, [clean])])
    assert events(live) == []

    push_all(live, token, [snapshot(3, [dirty]), snapshot(4, [dirty])])
    (event,) = events(live)
    assert (event["reason"], event["started_at"]) == ("unattributed", T0 + 4 * 15)


def test_a_poll_whose_unattributed_figure_is_unknown_leaves_the_event_as_it_is(
    live: Live,
) -> None:
    # A leaked context for an hour; the agent's two reads of the process list differ at
    # one poll in twelve (figure unknown). The event lasts, so its 30 min alert can fire.
    token = live.token("host-1")
    dirty = gpu(0, [process(1)], extra_bytes=10 * GIB)
    unknown = gpu(0, [process(1)], extra_bytes=10 * GIB, unattributed_bytes=None)
    push_all(live, token, [snapshot(n, [unknown if n % 12 == 5 else dirty]) for n in range(240)])
    (event,) = events(live)
    assert event["reason"] == "unattributed" and event["ended_at"] is None
    # Masked (a lost GPU) or gone, it closes as before.
    push_all(live, token, [snapshot(240, [gpu(0, [process(1)])])])
    (event,) = events(live)
    assert event["ended_at"] == T0 + 240 * 15


def test_the_outbox_holds_one_row_per_event_change_also_when_a_batch_is_retried(
    live: Live,
) -> None:
    token = live.token("host-1")
    reparented = process(7, used_gib=6, orphaned=True)
    dead = process(7, used_gib=6, orphaned=True, alive=False)
    lost = gpu(3, lost=True, memory_used_bytes=None, memory_free_bytes=None)
    first = body(
        snapshot(0, [gpu(0, [reparented]), gpu(3, [process(8)])]),
        snapshot(1, [gpu(0, [reparented]), gpu(3, [process(8)])]),  # a refresh: no change
        snapshot(2, [gpu(0, [dead]), lost]),  # reason moves; GPU 3 falls off the bus
    )
    second = body(snapshot(3, [gpu(0, []), gpu(3, [process(8)])]))  # exits; GPU 3 is back

    for batch in (first, first, second, second):  # each batch retried after a lost reply
        assert live.push(token, batch).status_code == 200

    kinds = {e["id"]: e["kind"] for e in events(live)}
    changes: dict[str, list[tuple[str, str]]] = {}
    for event_id, change, kind, reason in outbox(live):
        assert kinds[event_id] == kind
        changes.setdefault(kind, []).append((change, reason))
    assert changes == {
        "orphaned": [("opened", "reparented"), ("updated", "dead_pid"), ("closed", "dead_pid")],
        "gpu_lost": [("opened", "gpu_is_lost"), ("closed", "gpu_is_lost")],
        "gpu_back": [("recorded", "gpu_back")],
    }


def test_reported_events_and_agent_silence_write_the_outbox_too(live: Live) -> None:
    token = live.token("host-1")
    live.push(token, body(snapshot(0, [gpu(0, [process(1)])])))
    report = {
        "kind": "oom",
        "hostname": "host-1",
        "gpu_index": 0,
        "pid": 1,
        "summary": "CUDA out of memory",
        "occurred_at": T0 + 5,
    }
    for _ in range(2):  # a retried POST stores nothing more
        response = live.client.post(
            "/api/v1/events", json=report, headers={"Authorization": f"Bearer {token}"}
        )
        assert response.status_code == 200, response.text
    job_settings = ServerSettings(agent_push_interval_seconds=15, agent_silent_intervals=4)
    for minutes in (2, 3):  # opens once, then refreshes (no change)
        detect_silent_agents(database=live.database, settings=job_settings, now=T0 + minutes * 60)
    live.push(token, body(snapshot(20, [gpu(0, [process(1)])])))

    changes = [(change, kind) for _, change, kind, _ in outbox(live)]
    assert changes == [
        ("recorded", "oom"),
        ("opened", "agent_silent"),
        ("closed", "agent_silent"),
    ]
    with live.database.reader() as session:
        assert session.scalar(select(func.count(Event.id))) == 2


def test_saw_tooth_training_and_a_flat_full_gpu_raise_nothing(live: Live) -> None:
    token = live.token("host-1")
    snaps = []
    # Two hours pushed every 15.002 s: a 60 s saw-tooth between 18 and 58 GiB (the
    # sampling walks slowly through its phase), and a GPU held flat at 79 of 80 GiB.
    for seq in range(480):
        at = T0 + seq * 15.002
        phase = (at % 60) / 60
        trainer = process(11, used_gib=18 + 40 * phase, sm=0.9, user="bob")
        full = [process(21, used_gib=40, sm=0.7), process(22, used_gib=39, sm=0.4, user="carol")]
        snaps.append(snapshot(seq, [gpu(0, [trainer]), gpu(1, full)], at=at))
    push_all(live, token, snaps)

    assert events(live) == []
    assert outbox(live) == []


def test_a_cycle_longer_than_the_leak_window_is_no_leak_once_seen(live: Live) -> None:
    token = live.token("host-1")
    # Three hours of a job that builds up from 20 to 60 GiB over 45 minutes and frees
    # it at the end of each epoch: each rise lasts longer than the 30-minute window, so
    # only what the server keeps from before the window (the last cycle's top) tells it
    # from a leak. The first rise cannot be told: nothing was held before it.
    period = 45 * 60
    snaps = []
    for seq in range(720):
        at = T0 + seq * 15.0
        builder = process(11, used_gib=20 + 40 * ((at - T0) % period) / period, sm=0.9)
        snaps.append(snapshot(seq, [gpu(0, [builder])], at=at))
    push_all(live, token, snaps)

    first_top = T0 + period
    late = [e for e in events(live) if e["started_at"] > first_top + 120]
    assert late == [], late


def test_a_new_job_filling_a_gpu_a_finished_job_held_fuller_is_still_warned(
    live: Live,
) -> None:
    token = live.token("host-1")
    # Job A holds 76 of 80 GiB for 40 minutes and exits; job B starts at once and grows
    # 0.5 GiB a minute from 10 GiB. The GPU's history holds A's 76 GiB, which B passes
    # only minutes before the GPU is full: that height was another workload's, and rule
    # 4 (a verdict opens above what was held before) must look only at the history of
    # the processes on the GPU now.
    snaps = []
    for seq in range(160 + 280):
        at = T0 + seq * 15.0
        if seq < 160:
            held = [process(41, used_gib=76, sm=0.9, user="ann")]
        else:
            held = [process(42, used_gib=10 + (at - T0 - 2400) / 120, sm=0.9, user="ben")]
        snaps.append(snapshot(seq, [gpu(0, held)], at=at))
    push_all(live, token, snaps)

    (filling,) = events(live, kind="filling_up")
    grown = 10 + (filling["started_at"] - T0 - 2400) / 120  # GiB, when it opened
    # Its window covers 30 minutes of growth from B's start (25 GiB) and the GPU is then
    # full within the 2 h horizon: warned then, not once A's height leaves the history.
    assert grown < 27, f"warned only at {grown:.1f} GiB of 80"


def test_events_filter_by_open_true_and_false(live: Live) -> None:
    token = live.token("host-1")
    live.push(token, body(snapshot(0, [gpu(0, [process(7, orphaned=True)])])))
    live.push(
        token, body(snapshot(1, [gpu(0, [])]), snapshot(2, [gpu(0, [process(8, orphaned=True)])]))
    )

    assert [e["pid"] for e in events(live, open="true")] == [8]
    assert [e["pid"] for e in events(live, open="false")] == [7]
    assert sorted(e["pid"] for e in events(live)) == [7, 8]


def test_an_idle_hog_of_a_shared_gpu_is_runaway_and_not_also_idle(live: Live) -> None:
    token = live.token("host-1")
    hog = process(3, used_gib=75, sm=0.0, user="dave")
    snaps = [snapshot(seq, [gpu(0, [hog, process(4, used_gib=1)])]) for seq in range(80)]
    push_all(live, token, snaps)

    (event,) = events(live)
    assert (event["kind"], event["reason"], event["pid"]) == ("runaway", "share", 3)
    assert live.client.get("/api/v1/fleet").json()["idle_bytes"] == 0


def test_a_filling_gpu_opens_filling_up_naming_the_growing_process(live: Live) -> None:
    token = live.token("host-1")
    # 1 GiB/min on an 80 GiB GPU beside a flat 20 GiB job, polled every 15 s for 40 min.
    snaps = [
        snapshot(
            seq,
            [
                gpu(
                    0,
                    [
                        process(31, used_gib=10 + seq / 4, sm=0.9, user="erin"),
                        process(32, used_gib=20, sm=0.5, user="frank"),
                    ],
                )
            ],
        )
        for seq in range(160)
    ]
    push_all(live, token, snaps)

    (filling,) = events(live, kind="filling_up", open="true")
    assert (filling["pid"], filling["gpu_index"]) == (None, 0)
    evidence = filling["evidence"]
    assert 0 < evidence["time_to_full_seconds"] <= 7200
    (culprit,) = evidence["culprits"]
    assert (culprit["pid"], culprit["user"]) == (31, "erin")
    assert culprit["command"] == "python train.py --run 31"
    # What it held at the last bucket close, when the verdict was last evaluated.
    assert (10 + 150 / 4) * GIB <= culprit["memory_bytes"] <= (10 + 159 / 4) * GIB
    (leak,) = events(live, kind="runaway")
    assert (leak["reason"], leak["pid"]) == ("leak", 31)
    assert ("opened", "filling_up") in [(c, k) for _, c, k, _ in outbox(live)]


def test_idle_ends_when_its_gpu_falls_off_the_bus(live: Live) -> None:
    # Idle for over an hour, then the GPU is lost: "no activity for an hour" can no
    # longer be observed, and the fleet must not count its bytes as idle.
    token = live.token("host-1")
    idle = gpu(0, [process(9, used_gib=10, sm=0.0)])
    push_all(live, token, [snapshot(n, [idle]) for n in range(300)])
    assert [e["kind"] for e in events(live, open="true")] == ["idle"]
    lost = gpu(0, lost=True, memory_used_bytes=None, memory_free_bytes=None)
    push_all(live, token, [snapshot(300, [lost])])
    assert [e["kind"] for e in events(live, open="true")] == ["gpu_lost"]
    assert live.client.get("/api/v1/fleet").json()["idle_bytes"] == 0
