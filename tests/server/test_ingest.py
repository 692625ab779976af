"""Ingest over real HTTP (uvicorn + httpx) on SQLite and Postgres."""

from __future__ import annotations

import pytest
from sqlalchemy import func, select

from gpuwatch.server.ingest.models import SnapshotSeen
from gpuwatch.server.processes.models import ProcessLifetime, ProcessSample
from server.factories import GIB, big_host, body, gpu, process, snapshot
from server.harness import Live


def count(live: Live, model: type) -> int:
    with live.database.reader() as session:
        return session.scalar(select(func.count()).select_from(model)) or 0


def test_batch_is_stored_and_visible_through_the_read_api(live: Live) -> None:
    token = live.token("host-1")
    snaps = [big_host(seq) for seq in range(5)]

    response = live.push(token, body(*snaps))

    assert response.status_code == 200, response.text
    assert response.json() == {"accepted": 5, "duplicate": 0, "results": ["accepted"] * 5}
    host = live.client.get("/api/v1/hosts/host-1").json()
    assert host["last_seen_at"] == snaps[-1].collected_at
    assert len(host["gpus"]) == 8
    assert sum(len(g["processes"]) for g in host["gpus"]) == 50
    assert count(live, ProcessLifetime) == 50


def test_a_retried_snapshot_is_stored_once(live: Live) -> None:
    token = live.token("host-1")
    first = snapshot(0, [gpu(0, [process(100)])])
    second = snapshot(1, [gpu(0, [process(100)])])

    assert live.push(token, body(first)).json()["accepted"] == 1
    retry = live.push(token, body(first, second))

    assert retry.status_code == 200
    assert retry.json() == {"accepted": 1, "duplicate": 1, "results": ["duplicate", "accepted"]}
    assert count(live, SnapshotSeen) == 2
    assert count(live, ProcessLifetime) == 1


def test_a_key_repeated_within_one_batch_counts_once(live: Live) -> None:
    token = live.token("host-1")
    snap = snapshot(0, [gpu(0, [process(100)])])

    response = live.push(token, body(snap, snap))

    assert response.json()["results"] == ["accepted", "duplicate"]
    assert count(live, SnapshotSeen) == 1


def test_process_that_leaves_ends_its_lifetime_and_writes_its_last_bucket(live: Live) -> None:
    token = live.token("host-1")
    snaps = [snapshot(seq, [gpu(0, [process(100, used_gib=2 + seq)])]) for seq in range(6)]
    snaps.append(snapshot(6, [gpu(0, [])]))

    live.push(token, body(*snaps))

    page = live.client.get("/api/v1/processes", params={"host": "host-1"}).json()
    (item,) = page["items"]
    assert item["ended_at"] == snaps[-1].collected_at
    assert item["peak_bytes"] == 7 * GIB
    # 6 polls at 15 s span two 60 s buckets: both are written, the last one on exit.
    assert count(live, ProcessSample) == 2


def test_what_was_on_a_gpu_at_a_time(live: Live) -> None:
    token = live.token("host-1")
    early = [snapshot(seq, [gpu(2, [process(100)])]) for seq in range(4)]
    late = [snapshot(seq, [gpu(2, [process(200, user="bob")])]) for seq in range(4, 8)]
    live.push(token, body(*early, *late))

    def on_gpu_2_at(t: float) -> list[int]:
        params = {"host": "host-1", "gpu": 2, "at": t}
        return [
            p["pid"] for p in live.client.get("/api/v1/processes", params=params).json()["items"]
        ]

    assert on_gpu_2_at(early[1].collected_at) == [100]
    assert on_gpu_2_at(late[1].collected_at) == [200]


def test_a_reboot_ends_every_lifetime_of_the_host(live: Live) -> None:
    token = live.token("host-1")
    before = snapshot(0, [gpu(0, [process(100)])])
    after = snapshot(1, [gpu(0, [process(100, start_time=5.0)])], boot_id="boot-2")

    live.push(token, body(before, after))

    items = live.client.get("/api/v1/processes").json()["items"]
    ended = {p["start_time"]: p["ended_at"] for p in items}
    assert ended == {before.gpus[0].processes[0].start_time: before.collected_at, 5.0: None}


@pytest.mark.parametrize("late_first", [False, True])
def test_late_snapshots_do_not_move_state_backwards(live: Live, late_first: bool) -> None:
    token = live.token("host-1")
    new = snapshot(10, [gpu(0, [process(100, used_gib=9)])])
    old = snapshot(3, [gpu(0, [])])
    batches = [body(old), body(new)] if late_first else [body(new), body(old)]

    for batch in batches:
        assert live.push(token, batch).json()["accepted"] == 1

    host = live.client.get("/api/v1/hosts/host-1").json()
    assert host["last_seen_at"] == new.collected_at
    assert [p["current_bytes"] for p in host["gpus"][0]["processes"]] == [9 * GIB]
