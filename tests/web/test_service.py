"""The dashboard's grouped reads on SQLite and Postgres: what a tile says (the largest
holder as ingest keeps it on the GPU's row, ties included), the header's counts (flags per GPU, fullness as the API has
it), a fixed number of queries whatever the fleet size, and the chart's columns."""

from __future__ import annotations

import json
import os
import re
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from server.factories import GIB, T0, gpu, process, snapshot
from server.harness import make_token
from sqlalchemy import create_engine, event, text
from sqlalchemy.exc import OperationalError

from gpuwatch.server.database import Database, create_database
from gpuwatch.server.database.migrate import upgrade
from gpuwatch.server.fleet.service import fleet_summary
from gpuwatch.server.ingest.service import ingest_snapshots
from gpuwatch.server.web import service, tiles
from gpuwatch.server.web.templates.fleet import fleet_page
from gpuwatch.server.web.templates.layout import Chrome
from gpuwatch.settings import ServerSettings
from gpuwatch.snapshot import Gpu, GpuProcess, HostSnapshot
from gpuwatch.wire import IngestRequest

POSTGRES_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def database(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Database]:
    if request.param == "sqlite":
        db = create_database(f"sqlite:///{tmp_path / 'gpuwatch.db'}")
        upgrade(db)
        yield db
        db.dispose()
        return
    schema = f"gwweb_{uuid.uuid4().hex[:12]}"
    try:
        admin = create_engine(POSTGRES_URL, isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    except OperationalError as err:
        if os.environ.get("CI") == "true":
            pytest.fail(f"Postgres is required under CI=true but unreachable: {err}")
        pytest.skip("Postgres at 127.0.0.1:5432 is not reachable")
    db = create_database(f"{POSTGRES_URL}?options=-csearch_path%3D{schema}")
    try:
        upgrade(db)
        yield db
    finally:
        db.dispose()
        with admin.connect() as conn:
            conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()


@pytest.fixture
def settings(tmp_path: Path) -> ServerSettings:
    return ServerSettings(
        data_dir=tmp_path,
        scheduler=False,
        sample_interval_seconds=60,
        idle_window_seconds=600,
        agent_push_interval_seconds=15,
    )


def push(database: Database, settings: ServerSettings, snaps: list[HostSnapshot]) -> None:
    host = snaps[0].hostname
    with database.reader() as session:
        known = session.scalar(text("SELECT id FROM hosts WHERE hostname = :h"), {"h": host})
    if known is None:
        make_token(database, host)
    with database.writer() as session, session.begin():
        host_id = session.scalar(text("SELECT id FROM hosts WHERE hostname = :h"), {"h": host})
        ingest_snapshots(
            session=session,
            dialect=database.dialect,
            host_id=host_id,
            request=IngestRequest(snapshots=snaps),
            settings=settings,
            now=snaps[-1].collected_at,
        )


def tiles_of(host: tiles.FleetHost) -> list[list[object]]:
    """A host's tiles, as its card carries them for the page's script."""
    assert host.tiles is not None
    parsed: list[list[object]] = json.loads(host.tiles)
    return parsed


def header_fullness(fleet: tiles.Fleet) -> dict[str, int]:
    """GPUs per fullness bucket as the page's header shows them."""
    page = fleet_page(Chrome(root="", now=T0, firing=0, sign_out=False), fleet)
    legend = re.findall(r'<i class="sw [^"]*"></i>(\S+)(?: full)? <b>([\d,]+)</b>', page)
    return {name: int(count.replace(",", "")) for name, count in legend}


def shared_gpu(seq: int) -> list[Gpu]:
    return [
        gpu(
            0,
            [
                process(1, used_gib=4, user="alice"),
                process(2, used_gib=9, user="bob"),
                process(3, used_gib=2, user="alice"),
            ],
        ),
        gpu(1, []),
    ]


def test_a_tile_names_the_largest_holder_and_counts_the_rest(
    database: Database, settings: ServerSettings
) -> None:
    push(database, settings, [snapshot(s, shared_gpu(s), hostname="h1") for s in range(4)])
    with database.reader() as session:
        fleet = tiles.fleet_tiles(session=session, settings=settings, now=T0 + 60)
    (host,) = fleet.hosts
    assert (host.hostname, host.silent) == ("h1", False)
    busy, idle = tiles_of(host)
    # index, percent, used and total MiB, the largest holder's MiB, processes, users,
    # the largest holder, flags
    assert busy == [0, 18, 15 * 1024, 80 * 1024, 9 * 1024, 3, 2, "bob", 0]
    assert idle == [1, 0, 0, 80 * 1024, 0, 0, 0, None, 0]
    assert header_fullness(fleet)["0-25%"] == 2 and fleet.gpus == 2


def test_a_tie_for_largest_names_the_oldest_of_the_tied_holders(
    database: Database, settings: ServerSettings
) -> None:
    alice, carol, dave = (
        process(1, used_gib=1, user="alice"),
        process(2, used_gib=6, user="carol"),
        process(3, used_gib=6, user="dave"),
    )
    # dave's process was seen first, carol's is listed first: dave's is the older.
    snaps = [snapshot(0, [gpu(0, [dave])], hostname="h1")]
    snaps += [snapshot(s, [gpu(0, [alice, carol, dave])], hostname="h1") for s in (1, 2)]
    push(database, settings, snaps)
    with database.reader() as session:
        fleet = tiles.fleet_tiles(session=session, settings=settings, now=T0 + 30)
    ((index, _, used, _, largest, processes, users, user, _),) = tiles_of(fleet.hosts[0])
    assert (index, used, largest, processes, users) == (0, 13 * 1024, 6 * 1024, 3, 3)
    assert user == "dave"


def flagged_fleet(seq: int) -> list[Gpu]:
    """GPU 0: two dead processes still holding memory (two orphaned events on one GPU)
    beside a live one; GPU 1: one dead process, and dave computing nothing; GPU 2: a
    busy process, no flag."""

    def ghost(pid: int) -> GpuProcess:
        return process(pid, used_gib=2, sm=0.0, alive=False, orphaned=True, user="ghost")

    return [
        gpu(0, [ghost(10), ghost(11), process(12, used_gib=8, sm=0.9, user="carol")]),
        gpu(1, [ghost(20), process(21, used_gib=10, sm=0.0, user="dave")]),
        gpu(2, [process(30, used_gib=4, sm=0.9, user="erin")]),
    ]


def test_flags_are_counted_once_per_gpu_as_the_tiles_show_them(
    database: Database, settings: ServerSettings
) -> None:
    # Eleven minutes at 15 s: past the 600 s idle window, so dave's process is idle.
    snaps = [snapshot(s, flagged_fleet(s), hostname="h1") for s in range(45)]
    push(database, settings, snaps)
    now = snaps[-1].collected_at
    with database.reader() as session:
        fleet = tiles.fleet_tiles(session=session, settings=settings, now=now)
        open_orphans = session.scalar(
            text("SELECT count(*) FROM events WHERE kind = 'orphaned' AND ended_at IS NULL")
        )
    (host,) = fleet.hosts
    masks = [tile[-1] for tile in tiles_of(host)]
    orphaned, idle = (1 << tiles.TILE_FLAGS.index(kind) for kind in ("orphaned", "idle"))
    assert open_orphans == 3  # two on GPU 0, one on GPU 1
    assert [bool(mask & orphaned) for mask in masks] == [True, True, False]
    assert masks[1] & idle and not masks[2]
    assert fleet.flagged["orphaned"] == 2  # GPUs, not events
    assert fleet.flagged == {
        kind: sum(1 for mask in masks if mask & 1 << bit)
        for bit, kind in enumerate(tiles.TILE_FLAGS)
    }
    assert len(masks) == 3


def test_the_header_counts_fullness_as_the_fleet_api_does(
    database: Database, settings: ServerSettings
) -> None:
    push(database, settings, [snapshot(s, shared_gpu(s), hostname="busy") for s in range(2)])
    # 87.5% and 56%; then on the bounds: exactly 25% and 90%, and a MiB under 90%.
    heavy = [gpu(0, [process(1, used_gib=70)]), gpu(1, [process(2, used_gib=45)])]
    heavy += [gpu(2 + i, [process(4 + i, used_gib=gib)]) for i, gib in enumerate((20, 72))]
    heavy.append(gpu(4, [process(6, used_gib=72 - 1 / 1024)]))
    push(database, settings, [snapshot(s, heavy, hostname="heavy") for s in range(2)])
    quiet = [gpu(0, [process(3, used_gib=50)])]
    push(database, settings, [snapshot(0, quiet, hostname="quiet", at=T0 - 3600)])
    now = T0 + 30
    with database.reader() as session:
        fleet = tiles.fleet_tiles(session=session, settings=settings, now=now)
        summary = fleet_summary(session=session, settings=settings, now=now)
    fullness = header_fullness(fleet)
    assert fullness == summary.gpus_by_fullness
    assert fullness == {
        "0-25%": 2,  # the busy host's
        "25-50%": 1,
        "50-75%": 1,
        "75-90%": 2,
        "90-100%": 1,
        "unknown": 1,  # the silent host's GPU: its reading is stale
    }
    assert (fleet.gpus, fleet.silent_hosts) == (summary.gpus, len(summary.silent_hosts)) == (8, 1)


def test_the_fleet_is_read_in_the_same_queries_at_any_size(
    database: Database, settings: ServerSettings
) -> None:
    def statements(hosts: int) -> int:
        for n in range(hosts):
            name = f"n{hosts}-{n}"
            push(database, settings, [snapshot(s, shared_gpu(s), hostname=name) for s in range(2)])
        seen: list[str] = []

        def count(*args: object) -> None:
            seen.append(str(args[2]))

        event.listen(database.engine, "before_cursor_execute", count)
        try:
            with database.reader() as session:
                fleet = tiles.fleet_tiles(session=session, settings=settings, now=T0 + 30)
        finally:
            event.remove(database.engine, "before_cursor_execute", count)
        assert sum(len(tiles_of(h)) for h in fleet.hosts) == 2 * len(fleet.hosts)
        return sum(1 for statement in seen if statement.lstrip().upper().startswith("SELECT"))

    # Hosts with their tiles, GPUs per fullness bucket, held memory, GPUs per flag.
    assert statements(2) == statements(8) == 4


def test_a_chart_has_a_column_per_step_stacked_by_process(
    database: Database, settings: ServerSettings
) -> None:
    # 20 minutes at 15 s: pid 7 grows 1 GiB a minute, pid 8 holds 3 GiB.
    snaps = [
        snapshot(
            s,
            [gpu(0, [process(7, used_gib=1 + s // 4, user="erin"), process(8, used_gib=3)])],
            hostname="h1",
        )
        for s in range(80)
    ]
    push(database, settings, snaps)
    now = snaps[-1].collected_at
    with database.reader() as session:
        (ref,) = service.host_gpus(session=session, hostname="h1")
        history = service.histories(
            session=session, gpus=[ref], until=now, seconds=1200, interval=60, columns=10
        )[ref.id]
    assert history.step == 120  # two sample intervals per column
    assert history.since <= now - 1200 < history.since + history.step
    assert history.until > now
    erin, other = history.layers
    assert (erin.pid, erin.user, other.pid) == (7, "erin", 8)
    filled = [v for v in erin.values if v]
    assert filled == sorted(filled) and len(filled) >= 9
    assert max(erin.values) == erin.peak_bytes == (1 + 79 // 4) * GIB  # the live reading
    assert {v for v in other.values if v} == {3 * GIB}
    assert history.used[-1] == (1 + 79 // 4 + 3) * GIB


def test_a_chart_sums_the_smaller_processes_into_one_layer(
    database: Database, settings: ServerSettings
) -> None:
    many = [process(100 + i, used_gib=(1 + i) / 2, user=f"u{i}") for i in range(14)]
    push(database, settings, [snapshot(s, [gpu(0, many)], hostname="h1") for s in range(8)])
    with database.reader() as session:
        (ref,) = service.host_gpus(session=session, hostname="h1")
        history = service.histories(
            session=session, gpus=[ref], until=T0 + 8 * 15, seconds=3600, interval=60, columns=60
        )[ref.id]
    assert len(history.layers) == service.MAX_LAYERS
    assert [layer.pid for layer in history.layers[:3]] == [113, 112, 111]
    other = history.layers[-1]
    assert (other.lifetime_id, other.processes) == (None, 14 - service.MAX_LAYERS + 1)
    assert other.peak_bytes == sum(1 + i for i in range(5)) * GIB // 2
