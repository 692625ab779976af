"""A process that misses a poll and comes back (same pid and start time) reopens its
lifetime, whether it was ended in an earlier request or earlier in the same one
(docs/server.md, data model). The lifetime's identity is the table's unique key: a
second row of it refused the whole batch (422 quarantined) when the end was only in
the request's state, not yet in the database."""

from __future__ import annotations

from sqlalchemy import select

from gpuwatch.server.processes.models import ProcessLifetime
from server.factories import body, gpu, process, snapshot
from server.harness import Live


def lifetimes(live: Live) -> list[tuple[int, float | None]]:
    with live.database.reader() as session:
        rows = session.execute(
            select(ProcessLifetime.pid, ProcessLifetime.ended_at).order_by(ProcessLifetime.id)
        )
        return [(pid, ended) for pid, ended in rows]


def test_a_process_missing_one_poll_within_a_batch_reopens_its_lifetime(live: Live) -> None:
    token = live.token("host-1")
    snaps = [
        snapshot(1, [gpu(0, [process(100), process(300)])]),
        snapshot(2, [gpu(0, [process(100)])]),  # 300 missed one poll
        snapshot(3, [gpu(0, [process(100), process(300)])]),  # and is back
    ]

    response = live.push(token, body(*snaps))

    assert response.status_code == 200, response.text
    assert response.json()["results"] == ["accepted"] * 3
    assert lifetimes(live) == [(100, None), (300, None)]


def test_a_lifetime_closed_and_reopened_twice_in_one_batch_stays_one_row(live: Live) -> None:
    token = live.token("host-1")
    live.push(token, body(snapshot(1, [gpu(0, [process(300)])])))
    live.push(token, body(snapshot(2, [gpu(0, [])])))  # ended in the database
    on, off = [process(300)], []
    snaps = [snapshot(seq, [gpu(0, on if seq % 2 else off)]) for seq in range(3, 9)]

    response = live.push(token, body(*snaps))

    assert response.status_code == 200, response.text
    # Seq 8 does not list it: one row, ended at that snapshot.
    assert lifetimes(live) == [(300, snaps[-1].collected_at)]


def test_a_spool_drain_with_flickering_processes_is_stored_whole(live: Live) -> None:
    token = live.token("host-1")
    snaps = []
    for seq in range(1, 31):
        gpus = [
            gpu(g, [process(1000 + 10 * g + p) for p in range(5) if (seq + p) % 3 or p == 0])
            for g in range(4)
        ]
        snaps.append(snapshot(seq, gpus))

    response = live.push(token, body(*snaps))

    assert response.status_code == 200, response.text
    assert response.json()["accepted"] == 30
    assert len(lifetimes(live)) == 20


def test_a_new_boot_listing_the_same_process_reopens_it_instead_of_refusing(live: Live) -> None:
    token = live.token("host-1")
    live.push(token, body(snapshot(8, [gpu(0, [process(500)])], boot_id="b1")))

    response = live.push(token, body(snapshot(9, [gpu(0, [process(500)])], boot_id="b2")))

    assert response.status_code == 200, response.text
    assert response.json()["results"] == ["accepted"]
    assert lifetimes(live) == [(500, None)]


def test_a_boot_change_within_one_batch_is_stored(live: Live) -> None:
    token = live.token("host-1")
    snaps = [
        snapshot(1, [gpu(0, [process(500), process(600)])], boot_id="b1"),
        snapshot(2, [gpu(0, [process(500)])], boot_id="b2"),
    ]

    response = live.push(token, body(*snaps))

    assert response.status_code == 200, response.text
    # 600 ended with the old boot, at its last sighting; 500 is listed again.
    assert lifetimes(live) == [(500, None), (600, snaps[0].collected_at)]
