"""A filling-up alert blames the process that grew, not whoever holds its PID now.

The evidence names its culprits when a bucket closes; the alert is built from it at every
evaluation, overlaid with each culprit's current holder for its current memory. Matched
by PID alone, a grower that exited and whose PID the kernel gave to another process on
the same GPU before the next bucket close had its growth blamed on the newcomer: "bob's
pid 4242 (python -m ipykernel_launcher) holds 1.0 GiB, +1.1 GiB/min".
"""

from __future__ import annotations

from typing import Any

import pytest
from server.conftest import (  # noqa: F401 (fixtures)
    database,
    database_url,
    migrated_sqlite,
    postgres_url,
    sqlite_url,
)
from server.factories import T0, gpu, process, snapshot
from server.harness import make_token
from sqlalchemy import text

from gpuwatch.server.alerts import rules
from gpuwatch.server.alerts.config import AlertSettings
from gpuwatch.server.alerts.facts import EventFact, Facts, GpuFact, Holder, read_facts
from gpuwatch.server.database import Database
from gpuwatch.server.ingest.service import ingest_snapshots
from gpuwatch.settings import ServerSettings
from gpuwatch.wire import IngestRequest

GIB = 2**30
ALICE = {"pid": 4242, "slope_bytes_per_second": 2e7, "user": "alice", "command": "python train.py",
         "memory_bytes": 60 * GIB, "slurm_job_id": "777"}  # fmt: skip


def _facts(holder: Holder, culprit: dict[str, object], seen_at: float = T0) -> Facts:
    gpu_fact = GpuFact("h", 0, 80 * GIB, 75 * GIB, 0, True, (holder,))
    event = EventFact(
        "filling_up", "filling_up", "h", 0, None, None, None, T0 - 600, "",
        {"time_to_full_seconds": 600.0, "culprits": [culprit]}, seen_at=seen_at,
    )  # fmt: skip
    return Facts(gpus=[gpu_fact], events=[event])


def _culprits(facts: Facts) -> set[tuple[int, str | None, int | None]]:
    found = rules.evaluate(facts, AlertSettings(), now=T0 + 30)
    assert found
    return {(c.pid, c.user, c.memory_bytes) for a in found for c in a.culprits}


# A holder of PID 4242 now: (how it differs from the grower, the holder).
REUSED = {
    "another owner and command": Holder(4242, "bob", "python -m ipykernel_launcher", GIB),
    "first seen after the evidence": Holder(4242, None, None, GIB, first_seen_at=T0 + 10),
    "another lifetime": Holder(4242, "alice", "python train.py", GIB, lifetime_id=8),
}


@pytest.mark.parametrize("why", list(REUSED))
def test_a_reused_pid_is_not_blamed_for_the_growth(why: str) -> None:
    culprit = {**ALICE, "lifetime_id": 7} if why == "another lifetime" else ALICE
    assert _culprits(_facts(REUSED[why], culprit)) == {(4242, "alice", 60 * GIB)}
    (alert, *_) = rules.evaluate(_facts(REUSED[why], culprit), AlertSettings(), now=T0)
    assert alert.culprits[0].slurm_job_id == "777"  # the evidence's identity, in full


def test_the_same_process_still_gets_its_current_memory() -> None:
    same = Holder(4242, "alice", "python train.py", 62 * GIB, lifetime_id=7, first_seen_at=T0 - 900)
    assert _culprits(_facts(same, {**ALICE, "lifetime_id": 7})) == {(4242, "alice", 62 * GIB)}
    assert _culprits(_facts(same, ALICE)) == {(4242, "alice", 62 * GIB)}


@pytest.fixture
def settings(tmp_path: Any, database_url: str) -> ServerSettings:  # noqa: F811
    return ServerSettings(
        data_dir=tmp_path,
        database_url=database_url,
        scheduler=False,
        sample_interval_seconds=60,
        leak_min_duration_seconds=1800,
        agent_push_interval_seconds=15,
    )


def _ingest(db: Database, settings: ServerSettings, snaps: list[Any]) -> None:
    with db.writer() as session, session.begin():
        host_id = session.scalar(text("SELECT id FROM hosts WHERE hostname = 'host-1'"))
        ingest_snapshots(
            session=session,
            dialect=db.dialect,
            host_id=host_id,
            request=IngestRequest(snapshots=snaps),
            settings=settings,
            now=snaps[-1].collected_at,
        )


def test_through_ingest_the_pid_s_next_owner_is_not_blamed(
    database: Database,  # noqa: F811
    settings: ServerSettings,
) -> None:
    """Real ingest: erin's pid 31 fills GPU 0 for 40 minutes and exits; bob's job gets
    pid 31 (a later start time) and loads 20 GiB before the next bucket close."""
    make_token(database, "host-1")
    frank = process(32, used_gib=50, user="frank")
    snaps = [
        snapshot(seq, [gpu(0, [process(31, used_gib=1 + seq / 8, user="erin"), frank])])
        for seq in range(1, 161)
    ]
    for i in range(0, len(snaps), 80):
        _ingest(database, settings, snaps[i : i + 80])
    last = snaps[-1].collected_at
    bob = process(31, used_gib=20, user="bob", start_time=last)
    _ingest(database, settings, [snapshot(161, [gpu(0, [bob, frank])], at=last + 1)])

    with database.reader() as session:
        facts = read_facts(session=session, settings=settings, now=last + 2, ended_since=None)
        (seen_at,) = [e.seen_at for e in facts.events if e.kind == "filling_up"]
    assert seen_at is not None and seen_at <= last  # the evidence is erin's still
    found = rules.evaluate(facts, AlertSettings(), now=last + 2)
    blamed = {
        (c.pid, c.user) for a in found if a.rule.startswith("gpu_filling") for c in a.culprits
    }
    assert blamed == {(31, "erin")}
