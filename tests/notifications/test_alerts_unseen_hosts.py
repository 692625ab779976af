"""Missing data never resolves an alert: a silent host, a lost GPU, and a retired host.

A host's agent that dies while its GPU fills stops every reading of that GPU. The rules
then find nothing there, and the filling-up alert used to resolve ``keep_firing_for``
later: the receivers heard "Resolved: GPU 1 ... fills up in about 2.3 min" about a GPU
nobody could see. Now such an alert stays firing, as it was, until its host or GPU is
seen again (then it holds or resolves on what is seen) or the host is retired.

Real ingest, the real engine and a real signed webhook receiver over HTTP, on SQLite and
Postgres; time is an injected clock.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
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
from support.clock import FakeClock
from support.sink import Sink, sink

from gpuwatch.server.alerts import lifecycle, rules
from gpuwatch.server.alerts.config import AlertSettings
from gpuwatch.server.alerts.engine import AlertEngine
from gpuwatch.server.alerts.facts import EventFact, Facts, GpuFact, Holder
from gpuwatch.server.database import Database
from gpuwatch.server.hosts.retire import retire_host
from gpuwatch.server.ingest.service import ingest_snapshots
from gpuwatch.server.notifications.config import ReceiverConfig
from gpuwatch.server.notifications.receivers.base import build_receiver
from gpuwatch.settings import ServerSettings
from gpuwatch.wire import IngestRequest

GIB = 2**30
PUSH = 15.0
FILLED = T0 + 160 * PUSH  # the last snapshot of the fill


@pytest.fixture
def settings(tmp_path: Any, database_url: str) -> ServerSettings:  # noqa: F811
    return ServerSettings.model_validate(
        {
            "data_dir": tmp_path,
            "database_url": database_url,
            "scheduler": False,
            "sample_interval_seconds": 60,
            "leak_min_duration_seconds": 1800,
            "agent_push_interval_seconds": PUSH,
            "alerts": {
                "group_wait": "0s",
                "group_interval": "1m",
                "rules": {"gpu_filling_up_warning": {"for": "0s"}},
            },
        }
    )


class Fleet:
    """host-1's snapshots through the real ingest, and the engine run at chosen times."""

    def __init__(self, db: Database, settings: ServerSettings, clock: FakeClock, hook: Sink):
        self.database, self.settings, self.clock, self.hook = db, settings, clock, hook
        self.client = httpx.Client(trust_env=False)
        config = ReceiverConfig(name="hook", type="webhook", url=hook.url, secret="s")
        receiver = build_receiver(config, client=self.client, clock=clock)
        self.engine = AlertEngine(receivers={"hook": receiver}, clock=clock, sleep=clock.advance)
        self.sequence = 0
        make_token(db, "host-1")

    def push(self, gpus: list[Any], at: float) -> None:
        self.sequence += 1
        self.push_all([snapshot(self.sequence, gpus, at=at)])

    def push_all(self, snaps: list[Any]) -> None:
        with self.database.writer() as session, session.begin():
            host_id = session.scalar(text("SELECT id FROM hosts WHERE hostname = 'host-1'"))
            ingest_snapshots(
                session=session,
                dialect=self.database.dialect,
                host_id=host_id,
                request=IngestRequest(snapshots=snaps),
                settings=self.settings,
                now=snaps[-1].collected_at,
            )

    def fill(self) -> None:
        """40 minutes of erin's pid 31 growing 1 GiB/min beside frank's flat 20 GiB."""
        snaps = [
            snapshot(
                seq,
                [
                    gpu(
                        0,
                        [process(31, used_gib=10 + seq / 4, user="erin"), process(32, used_gib=20)],
                    )
                ],
            )
            for seq in range(1, 161)
        ]
        self.sequence = 160
        for i in range(0, len(snaps), 80):
            self.push_all(snaps[i : i + 80])

    def run(self, at: float) -> None:
        self.clock.now = max(self.clock.now, at)
        self.engine.run(database=self.database, settings=self.settings, now=at)

    def alerts(self, rule: str) -> list[tuple[str, float | None]]:
        with self.database.reader() as session:
            rows = session.execute(
                text("SELECT state, resolved_at FROM alerts WHERE rule = :r ORDER BY id"),
                {"r": rule},
            ).all()
        return [(r.state, r.resolved_at) for r in rows]

    def told(self, rule: str) -> list[tuple[float, str]]:
        """(when, status) of every notification of ``rule`` the webhook received."""
        return [
            (d.at, a["status"])
            for d in self.hook.deliveries
            for a in d.body["alerts"]
            if a["rule"] == rule
        ]


@pytest.fixture
def fleet(database: Database, settings: ServerSettings) -> Iterator[Fleet]:  # noqa: F811
    clock = FakeClock(T0)
    with sink(clock) as hook:
        fleet = Fleet(database, settings, clock, hook)
        yield fleet
        fleet.client.close()


def test_a_filling_up_alert_is_not_resolved_while_its_host_is_silent(fleet: Fleet) -> None:
    warning = "gpu_filling_up_warning"
    fleet.fill()
    fleet.run(FILLED)
    assert fleet.alerts(warning) == [("firing", None)]
    assert fleet.told(warning) == [(FILLED, "firing")]

    # The agent dies. An hour of evaluations: far past the silence threshold (1 min)
    # and keep_firing_for (10 min).
    t = FILLED
    while t < FILLED + 3600:
        t += 300
        fleet.run(t)
    assert fleet.alerts(warning) == [("firing", None)]
    assert [status for _, status in fleet.told(warning)] == ["firing"]

    # It comes back: erin's job has ended. What is seen now ends the alert, once.
    back = t + 60
    for step in range(6):
        fleet.push([gpu(0, [process(32, used_gib=20)])], at=back + step * PUSH)
    for step in range(3):
        fleet.run(back + 5 * PUSH + step * 60)
    assert [state for state, _ in fleet.alerts(warning)] == ["resolved"]
    assert [status for _, status in fleet.told(warning)] == ["firing", "resolved"]
    assert fleet.told(warning)[-1][0] >= back


def test_an_alert_on_a_lost_gpu_holds_until_the_gpu_is_seen_again(fleet: Fleet) -> None:
    """The ECC alert of GPU 0 (no keep_firing_for): the GPU falls off the bus for 20
    minutes (gpu_lost says so), and the ECC alert is neither resolved nor told resolved
    meanwhile, though its host reports all along."""
    ecc = "gpu_ecc_uncorrected"
    sick = gpu(0, [process(7)], ecc_uncorrected_volatile=2)
    lost = gpu(0, lost=True, memory_used_bytes=None, memory_free_bytes=None)
    fleet.push([sick], at=T0)
    fleet.run(T0)
    assert fleet.alerts(ecc) == [("firing", None)]
    t = T0
    while t < T0 + 1200:
        t += PUSH
        fleet.push([lost], at=t)
        if t % 120 == 0:
            fleet.run(t)
    assert fleet.alerts(ecc) == [("firing", None)]
    assert fleet.alerts("gpu_lost") == [("firing", None)]
    assert [status for _, status in fleet.told(ecc)] == ["firing"]

    # Back, after a reset: no ECC errors. Seen, so it resolves (and gpu_lost too).
    t += PUSH
    fleet.push([gpu(0, [process(7)], ecc_uncorrected_volatile=0)], at=t)
    fleet.run(t)
    assert fleet.alerts(ecc) == [("resolved", t)]
    assert fleet.alerts("gpu_lost") == [("resolved", t)]


def test_a_retired_host_s_alerts_resolve(fleet: Fleet) -> None:
    """A silent host is unseen; a retired one is gone: its alerts end."""
    ecc = "gpu_ecc_uncorrected"
    fleet.push([gpu(0, [process(7)], ecc_uncorrected_volatile=2)], at=T0)
    fleet.run(T0)
    for minute in range(5, 31, 5):
        fleet.run(T0 + 60 * minute)  # silent since T0: 1 min
    assert fleet.alerts(ecc) == [("firing", None)]

    retired = T0 + 31 * 60
    with fleet.database.writer() as session, session.begin():
        retire_host(session=session, dialect=fleet.database.dialect, hostname="host-1", now=retired)
    fleet.run(retired)
    assert fleet.alerts(ecc) == [("resolved", retired)]
    assert [status for _, status in fleet.told(ecc)] == ["firing", "resolved"]


# -- the pure parts: rules find nothing on an unseen GPU, the life cycle holds -------


def _filling(current: bool) -> Facts:
    holder = Holder(31, "erin", "python train.py", 60 * GIB)
    event = EventFact(
        "filling_up", "filling_up", "box2", 1, None, None, None, T0, "filling",
        {"time_to_full_seconds": 140.0, "culprits": [{"pid": 31, "slope_bytes_per_second": 1e8}]},
    )  # fmt: skip
    gpu_fact = GpuFact("box2", 1, 80 * GIB, 75 * GIB, 0, current, (holder,))
    unseen = frozenset() if current else frozenset({("box2", None)})
    return Facts(gpus=[gpu_fact], events=[event], unseen=unseen)


# (Not "gpu" as an id: tests with that keyword need a real GPU.)
@pytest.mark.parametrize("gone", ["silent_host", "lost_device"])
def test_the_life_cycle_holds_a_firing_alert_it_cannot_see(gone: str) -> None:
    config = AlertSettings()
    seen = _filling(current=True)
    found = rules.evaluate(seen, config, now=T0)
    active = {a.fingerprint: a for a in lifecycle.advance({}, found, config, now=T0)}
    active = {a.fingerprint: a for a in lifecycle.advance(active, found, config, now=T0 + 60)}
    assert sorted(a.rule for a in active.values() if a.state == "firing") == [
        "gpu_filling_up_critical",
        "gpu_filling_up_warning",
    ]

    scope = ("box2", None) if gone == "silent_host" else ("box2", 1)
    unseen = Facts(_filling(current=False).gpus, seen.events, unseen=frozenset({scope}))
    assert rules.evaluate(unseen, config, now=T0) == []  # nothing to judge
    for hours in (1, 24):
        assert lifecycle.advance(active, [], config, now=T0 + hours * 3600, sees=unseen.sees) == []
    # Seen again and not holding: resolved.
    ended = lifecycle.advance(active, [], config, now=T0 + 86400, sees=seen.sees)
    assert {a.state for a in ended} == {"resolved"}


def test_alerts_about_the_missing_data_itself_are_not_held() -> None:
    config = AlertSettings()
    unseen = Facts(unseen=frozenset({("box2", None)}))

    def state(rule: str, state: str, gpu: str | None = "1") -> lifecycle.AlertState:
        labels = {"rule": rule, "hostname": "box2", **({"gpu": gpu} if gpu else {})}
        return lifecycle.AlertState(
            rules.fingerprint(labels), rule, labels, "warning", state, "", "", [], T0, T0, T0
        )

    active = {
        a.fingerprint: a
        for a in (
            state("gpu_nearly_full", "pending"),
            state("agent_silent", "firing", gpu=None),
            state("gpu_lost", "firing"),
            state("process_reaped", "firing"),
            state("gpu_filling_up_warning", "firing"),
        )
    }
    changed = lifecycle.advance(active, [], config, now=T0 + 3600, sees=unseen.sees)
    outcome = {a.rule: "dropped" if a.dropped else a.state for a in changed}
    assert outcome == {
        "agent_silent": "resolved",
        "gpu_lost": "resolved",
        "process_reaped": "resolved",
    }  # the filling-up warning is held, and the pending nearly-full alert too
    seen = lifecycle.advance(active, [], config, now=T0 + 3600)
    assert {a.rule: "dropped" if a.dropped else a.state for a in seen}["gpu_nearly_full"] == (
        "dropped"
    )
