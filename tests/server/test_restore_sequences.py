"""New snapshots are applied after a VM restore and after an agent restart with its clock
behind; retries are still duplicates. Real spool, real server over HTTP, both databases.

Audit finding: a restored VM's agent sent again the sequences it had sent after the VM
snapshot, with new content: answered ``duplicate``, dropped, and the host froze. An
agent restarted with its clock 20 minutes behind started its sequence below the last
one applied: every snapshot ``late`` until the clock caught up.
"""

from __future__ import annotations

from sqlalchemy import select

from gpuwatch.agent.spool import Spool
from gpuwatch.server.processes.models import ProcessLifetime
from gpuwatch.snapshot import HostSnapshot
from gpuwatch.wire import ingest_request_json
from server.factories import T0, body, gpu, process, snapshot
from server.harness import Live


def _open_pids(live: Live) -> list[int]:
    with live.database.reader() as session:
        return sorted(
            session.scalars(select(ProcessLifetime.pid).where(ProcessLifetime.ended_at.is_(None)))
        )


def _results(live: Live, token: str, *snaps: HostSnapshot) -> list[str]:
    response = live.push(token, body(*snaps))
    assert response.status_code == 200, response.text
    return list(response.json()["results"])


def test_after_a_vm_restore_the_repeated_sequences_are_new_snapshots(live: Live) -> None:
    token = live.token("vm-1")
    before = [
        snapshot(seq, [gpu(0, [process(70), process(71)])], hostname="vm-1") for seq in range(5)
    ]
    assert _results(live, token, *before) == ["accepted"] * 5
    # Restored to its state after sequence 1: it sends 2, 3, ... again, seen now
    # (later times), and pid 70 is gone.
    restored = [
        snapshot(seq, [gpu(0, [process(71)])], hostname="vm-1", at=T0 + 3600 + 15 * seq)
        for seq in (2, 3)
    ]

    assert _results(live, token, *restored) == ["accepted", "accepted"]
    assert _open_pids(live) == [71]
    # A retry of what it sent since is still a retry.
    assert _results(live, token, restored[1]) == ["duplicate"]
    assert _results(live, token, before[4]) == ["duplicate"]


def test_a_retry_with_the_same_time_is_a_duplicate_whatever_else_it_says(live: Live) -> None:
    token = live.token("host-1")
    first = snapshot(1, [gpu(0, [process(70)])])
    assert _results(live, token, first) == ["accepted"]

    assert _results(live, token, first) == ["duplicate"]
    assert _open_pids(live) == [70]


def _spool_and_push(live: Live, token: str, spool: Spool, snap: HostSnapshot) -> list[str]:
    """The agent's path: spooled, then sent as the spool holds it."""
    spool.append(snap)
    batch = spool.peek_batch(10, 2**20)
    live.clock.now = max(live.clock.now, snap.collected_at)
    response = live.client.post(
        "/api/v1/snapshots",
        content=ingest_request_json([r.body for r in batch], 0),
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
    )
    assert response.status_code == 200, response.text
    spool.ack(batch)
    return list(response.json()["results"])
