"""A process listed twice on one GPU in one snapshot is refused (422), as a GPU listed
twice is: stored, it was one lifetime whose memory counted once."""

from __future__ import annotations

from sqlalchemy import func, select

from gpuwatch.server.ingest.models import SnapshotSeen
from server.factories import body, gpu, process, snapshot
from server.harness import Live


def stored(live: Live) -> int:
    with live.database.reader() as session:
        return session.scalar(select(func.count()).select_from(SnapshotSeen)) or 0


def test_a_process_listed_twice_on_one_gpu_is_refused_like_a_gpu_listed_twice(
    live: Live,
) -> None:
    token = live.token("host-1")
    # Built as JSON: the model refuses to hold it.
    twice = body(snapshot(1, [gpu(0, [process(200, used_gib=1)])]))
    processes = twice["snapshots"][0]["gpus"][0]["processes"]
    processes.append(dict(processes[0]))

    response = live.push(token, twice)

    assert response.status_code == 422, response.text
    (error,) = response.json()["detail"]
    assert error["type"] == "value_error"
    assert error["loc"] == ["snapshots", 0, "gpus", 0]
    assert "appears twice on one GPU" in error["msg"]
    assert stored(live) == 0


def test_one_process_with_a_compute_and_a_graphics_context_is_accepted(live: Live) -> None:
    # What NVML reports for a process with both contexts, and the agent sends.
    token = live.token("host-1")
    both = snapshot(1, [gpu(0, [process(200), process(200, kind="graphics")])])

    response = live.push(token, body(both))

    assert response.status_code == 200, response.text
    assert stored(live) == 1


def test_the_same_pid_on_two_gpus_is_two_processes(live: Live) -> None:
    token = live.token("host-1")
    spread = snapshot(1, [gpu(0, [process(200)]), gpu(1, [process(200)])])

    assert live.push(token, body(spread)).status_code == 200
