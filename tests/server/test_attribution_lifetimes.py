"""Who a process was is never blanked: a dead PID's new lifetime (no start time) takes
the identity of the lifetime that held the PID on that GPU, so its ``dead_pid`` event
names the user; and an unknown value in a later snapshot (a process read as it
exited) never overwrites the stored one. Real server over HTTP, SQLite and Postgres."""

from __future__ import annotations

from typing import Any

from sqlalchemy import select

from gpuwatch.server.events.models import Event
from gpuwatch.server.processes.models import ProcessLifetime
from gpuwatch.snapshot import GpuProcess, ProcessOwner
from server.factories import GIB, T0, body, gpu, process, snapshot
from server.harness import Live

PID = 6001
STARTED = T0 - 5000
OWNER = ProcessOwner(user="alice", uid=1000, container_id="0123456789ab" * 4)


def alive() -> GpuProcess:
    listed = process(PID, start_time=STARTED)
    return listed.model_copy(update={"owner": OWNER, "command": "python train.py --big"})


def unknown(**fields: Any) -> GpuProcess:
    """The PID as /proc shows it once the process is gone: nothing left to read."""
    values: dict[str, Any] = {"pid": PID, "used_bytes": 30 * GIB, "sm_ratio": 0.0, "alive": False}
    return GpuProcess(**{**values, **fields})


def lifetimes(live: Live) -> list[tuple[Any, ...]]:
    with live.database.reader() as session:
        rows = session.execute(
            select(
                ProcessLifetime.start_time,
                ProcessLifetime.user,
                ProcessLifetime.command,
                ProcessLifetime.container_id,
                ProcessLifetime.ended_at,
            ).order_by(ProcessLifetime.id)
        )
        return [tuple(row) for row in rows]


def test_a_dead_pids_lifetime_takes_the_identity_of_the_process_that_held_it(live: Live) -> None:
    token = live.token("host-1")
    first = snapshot(1, [gpu(0, [alive()])])
    dead = [snapshot(seq, [gpu(0, [unknown()])]) for seq in (2, 3)]

    response = live.push(token, body(first, *dead))

    assert response.status_code == 200, response.text
    assert lifetimes(live) == [
        (STARTED, "alice", "python train.py --big", OWNER.container_id, dead[0].collected_at),
        (None, "alice", "python train.py --big", OWNER.container_id, None),
    ]
    with live.database.reader() as session:
        (event,) = session.execute(select(Event.reason, Event.user)).all()
    assert tuple(event) == ("dead_pid", "alice")


def test_an_unknown_value_never_overwrites_a_known_one(live: Live) -> None:
    token = live.token("host-1")
    half_read = alive().model_copy(update={"command": None, "name": None, "owner": ProcessOwner()})

    response = live.push(
        token, body(snapshot(1, [gpu(0, [alive()])]), snapshot(2, [gpu(0, [half_read])]))
    )

    assert response.status_code == 200, response.text
    assert lifetimes(live) == [
        (STARTED, "alice", "python train.py --big", OWNER.container_id, None)
    ]


def test_a_process_with_its_own_start_time_inherits_nothing(live: Live) -> None:
    """A reused PID is another process, whatever the previous one was."""
    token = live.token("host-1")
    later = unknown(alive=True, start_time=T0 - 10)

    response = live.push(
        token, body(snapshot(1, [gpu(0, [alive()])]), snapshot(2, [gpu(0, [later])]))
    )

    assert response.status_code == 200, response.text
    assert lifetimes(live)[1] == (T0 - 10, None, None, None, None)


def test_a_dead_pid_on_another_gpu_inherits_nothing(live: Live) -> None:
    token = live.token("host-1")
    first = snapshot(1, [gpu(0, [alive()]), gpu(1, [])])
    other = snapshot(2, [gpu(0, [alive()]), gpu(1, [unknown()])])

    response = live.push(token, body(first, other))

    assert response.status_code == 200, response.text
    assert lifetimes(live)[1] == (None, None, None, None, None)
