"""A small, realistic fleet pushed through the real ingest, for the dashboard's tests.

Forty minutes of 15 s snapshots from three hosts (built with the server tests'
factories), an agent-reported reap and OOM, and one run of the alert engine:

* ``gpu-a`` GPU 0: alice and bob training, steady; GPU 1 filling up (erin's process
  grows 1 GiB a minute beside frank's flat one: ``filling_up`` and a leak).
  One of bob's commands carries markup, as an untrusted agent may send.
* ``gpu-b`` GPU 0: a dead process still holding 12 GiB (``orphaned``), and carol;
  GPU 1: dave holding 10 GiB with no SM activity (``idle``); GPU 2 falls off the bus
  at the end (``gpu_lost``, which the alert engine fires at once); GPU 3 empty.
* ``gpu-c``: reported for the first few minutes only, so it is silent now.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx
from server.factories import GIB, T0, body, gpu, process, snapshot
from server.harness import FakeClock, make_token

from gpuwatch.server.database import Database
from gpuwatch.settings import ServerSettings

SNAPSHOTS = 160  # 40 min at 15 s
MARKUP_COMMAND = "python -c \"print('<script>alert(1)</script>')\" --tag <b>bold</b>"
MARKUP_USER = "bob"


@dataclass(frozen=True)
class Fleet:
    """Where the interesting things are, for assertions."""

    filling: tuple[str, int] = ("gpu-a", 1)
    steady: tuple[str, int] = ("gpu-a", 0)
    orphaned: tuple[str, int] = ("gpu-b", 0)
    idle: tuple[str, int] = ("gpu-b", 1)
    lost: tuple[str, int] = ("gpu-b", 2)
    empty: tuple[str, int] = ("gpu-b", 3)
    silent_host: str = "gpu-c"
    reaped_pid: int = 4200


def _host_a(seq: int) -> list[Any]:
    return [
        gpu(
            0,
            [
                process(101, used_gib=30, sm=0.9, user="alice"),
                process(102, used_gib=20, sm=0.6, user=MARKUP_USER).model_copy(
                    update={"command": MARKUP_COMMAND}
                ),
            ],
        ),
        gpu(
            1,
            [
                process(131, used_gib=10 + seq / 4, sm=0.9, user="erin"),
                process(132, used_gib=20, sm=0.5, user="frank"),
            ],
        ),
    ]


def _host_b(seq: int) -> list[Any]:
    # A dead PID has no parent for the agent to check: not reparented, not alive.
    ghost = process(4100, used_gib=12, sm=0.0, alive=False, orphaned=False, user="ghost")
    reaped = [process(4200, used_gib=6, sm=0.0, user="carol")] if seq < 80 else []
    lost = seq >= SNAPSHOTS - 2
    return [
        gpu(0, [ghost, process(201, used_gib=10, sm=0.7, user="carol"), *reaped]),
        gpu(1, [process(301, used_gib=10, sm=0.0, user="dave")]),
        gpu(2, lost=True, memory_used_bytes=None, memory_free_bytes=None)
        if lost
        else gpu(2, [process(401, used_gib=40, sm=0.8, user="alice")]),
        gpu(3, []),
    ]


def _host_c(seq: int) -> list[Any]:
    return [gpu(0, [process(501, used_gib=5, user="gina")])]


def populate(
    client: httpx.Client, database: Database, clock: FakeClock, settings: ServerSettings, app: Any
) -> Fleet:
    """Push the scenario through ``client`` (a live server) and run the alert engine."""
    tokens = {name: make_token(database, name) for name in ("gpu-a", "gpu-b", "gpu-c")}
    builders = {"gpu-a": _host_a, "gpu-b": _host_b, "gpu-c": _host_c}
    for first in range(0, SNAPSHOTS, 40):
        for name, build in builders.items():
            last = 12 if name == "gpu-c" else SNAPSHOTS
            seqs = range(first, min(first + 40, last))
            if not seqs:
                continue
            snaps = [snapshot(seq, build(seq), hostname=name) for seq in seqs]
            newest = snaps[-1].collected_at
            clock.now = max(clock.now, newest)
            response = client.post(
                "/api/v1/snapshots",
                json=body(*snaps),
                headers={"Authorization": f"Bearer {tokens[name]}"},
            )
            assert response.status_code == 200, response.text
    for kind, pid, at, summary in (
        ("reaped", 4200, T0 + 80 * 15, "reaped idle pid 4200 (carol), freed 6.0 GiB"),
        ("oom", 131, T0 + 150 * 15, "CUDA out of memory in pid 131 (erin)"),
    ):
        host, index = ("gpu-b", 0) if kind == "reaped" else ("gpu-a", 1)
        report = {
            "kind": kind,
            "hostname": host,
            "gpu_index": index,
            "pid": pid,
            "user": "carol" if kind == "reaped" else "erin",
            "held_bytes": 6 * GIB,
            "summary": summary,
            "occurred_at": at,
        }
        response = client.post(
            "/api/v1/events", json=report, headers={"Authorization": f"Bearer {tokens[host]}"}
        )
        assert response.status_code == 200, response.text
    clock.now = T0 + SNAPSHOTS * 15 + 5
    silence = {
        "matchers": [{"name": "rule", "value": "idle_holder"}],
        "duration_seconds": 3600,
        "created_by": "ops",
        "comment": "dave's notebook, <i>known</i>",
    }
    response = client.post("/api/v1/silences", json=silence)
    assert response.status_code == 201, response.text
    app.state.gpuwatch.alerts.run(database=database, settings=settings, now=clock.now)
    return Fleet()
