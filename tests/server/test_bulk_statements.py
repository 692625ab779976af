"""Ingest's bulk statements write what the rows say, on both databases (on Postgres as
one statement over arrays: gpuwatch/server/database/bulk.py)."""

from __future__ import annotations

from sqlalchemy import select

from gpuwatch.server.database import Database
from gpuwatch.server.hosts.models import GpuWindow
from gpuwatch.server.ingest import state
from gpuwatch.server.processes.models import ProcessLifetime, ProcessSample
from server.factories import body, gpu, process, snapshot
from server.harness import Live


def _lifetime_ids(database: Database) -> list[int]:
    with database.reader() as session:
        return list(session.scalars(select(ProcessLifetime.id).order_by(ProcessLifetime.id)))


def test_updates_inserts_and_upserts_write_every_value_as_given(live: Live) -> None:
    token = live.token("host-1")
    procs = [process(100 + i, used_gib=1 + i) for i in range(3)]
    assert live.push(token, body(snapshot(0, [gpu(0, procs)]))).status_code == 200
    ids = _lifetime_ids(live.database)
    # Ints where a column is a double, None beside values, all-None columns, bytes.
    hot = [
        (True, 1_800_000_100, 5 * 2**30, None, 0.5, None, None, None, None, None, ids[0]),
        (False, 1_800_000_100.5, None, 7, None, None, 1_800_000_060, 1, 2, 0, ids[1]),
    ]
    with live.database.writer() as session:
        connection = session.connection()
        state._UPDATE_LIFETIMES_HOT.execute(connection, hot)
        samples = state._INSERT_PROCESS_SAMPLES[live.database.dialect]
        # The same key twice in one batch: the first row stands.
        samples.execute(connection, [(ids[2], 60, 1, 2, 0.25), (ids[2], 60, 9, 9, 1)])
        windows = state._UPSERT_GPU_WINDOWS[live.database.dialect]
        gpu_id = session.scalars(select(ProcessLifetime.gpu_id)).first()
        windows.execute(connection, [(gpu_id, b"\x00first")])
        windows.execute(connection, [(gpu_id, b"\x01second")])
        session.commit()

    with live.database.reader() as session:
        rows = {lt.id: lt for lt in session.scalars(select(ProcessLifetime))}
        sample = session.scalars(select(ProcessSample)).one()
        window = session.scalars(select(GpuWindow)).one()
    first, second, untouched = rows[ids[0]], rows[ids[1]], rows[ids[2]]
    assert (first.orphaned, first.last_seen_at, first.current_bytes) == (
        True,
        1_800_000_100.0,
        5 * 2**30,
    )
    assert (first.peak_bytes, first.sm_ratio, first.bucket_start_at) == (None, 0.5, None)
    assert (second.last_seen_at, second.peak_bytes, second.bucket_start_at) == (
        1_800_000_100.5,
        7,
        1_800_000_060.0,
    )
    assert (second.bucket_min_bytes, second.bucket_max_bytes, second.bucket_max_sm_ratio) == (
        1,
        2,
        0.0,
    )
    assert untouched.current_bytes == 3 * 2**30  # a row not in the batch is left alone
    assert (sample.lifetime_id, sample.t, sample.used_bytes, sample.sm_ratio) == (
        ids[2],
        60.0,
        1,
        0.25,
    )
    assert window.recent_window == b"\x01second"


def test_a_single_row_is_written_as_given(live: Live) -> None:
    # On Postgres one row goes as the plain statement, not over arrays: the same values
    # must land, ints where a column is a double and None beside values included.
    token = live.token("host-1")
    procs = [process(100 + i, used_gib=1 + i) for i in range(2)]
    assert live.push(token, body(snapshot(0, [gpu(0, procs)]))).status_code == 200
    ids = _lifetime_ids(live.database)
    one = (True, 1_800_000_200, 6 * 2**30, None, 1, None, 1_800_000_120, 3, 4, None, ids[1])
    with live.database.writer() as session:
        state._UPDATE_LIFETIMES_HOT.execute(session.connection(), [one])
        session.commit()

    with live.database.reader() as session:
        rows = {lt.id: lt for lt in session.scalars(select(ProcessLifetime))}
    written, untouched = rows[ids[1]], rows[ids[0]]
    assert (written.orphaned, written.last_seen_at, written.current_bytes) == (
        True,
        1_800_000_200.0,
        6 * 2**30,
    )
    assert (written.peak_bytes, written.sm_ratio, written.idle_since) == (None, 1.0, None)
    assert (written.bucket_start_at, written.bucket_min_bytes, written.bucket_max_bytes) == (
        1_800_000_120.0,
        3,
        4,
    )
    assert written.bucket_max_sm_ratio is None
    assert untouched.current_bytes == 1 * 2**30
