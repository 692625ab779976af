"""Writers of one process take turns before SQLite's lock (gpuwatch/server/database/core.py)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from sqlalchemy import event, text

from gpuwatch.errors import DatabaseError
from gpuwatch.server.database import Database, create_database
from gpuwatch.server.database.core import WaitTimeout, WriteTurns, is_unavailable, is_wait_timeout
from server.harness import FakeClock


@pytest.fixture
def sqlite_db(tmp_path: Path) -> Iterator[Database]:
    # A busy timeout far below how long the first writer holds the lock: a second
    # writer that went to SQLite's lock instead of waiting its turn would fail.
    db = create_database(f"sqlite:///{tmp_path / 'turns.db'}", sqlite_busy_timeout_seconds=0.05)
    with db.begin_write() as conn:
        conn.execute(text("CREATE TABLE t (writer TEXT)"))
    yield db
    db.dispose()


def _begins(db: Database) -> list[str]:
    seen: list[str] = []
    event.listen(db.engine, "begin", lambda conn: seen.append(threading.current_thread().name))
    return seen


def _wait_until(condition: Callable[[], bool], *, seconds: float = 10.0) -> None:
    # Polls a condition the other thread sets; the deadline only bounds a broken run.
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "condition never held"
        time.sleep(0.001)


def test_second_writer_waits_for_its_turn_not_for_sqlites_lock(sqlite_db: Database) -> None:
    turns = sqlite_db.write_turns
    assert turns is not None
    begins = _begins(sqlite_db)
    errors: list[BaseException] = []

    def second() -> None:
        try:
            with sqlite_db.writer() as session:
                session.execute(text("INSERT INTO t VALUES ('second')"))
                session.commit()
        except BaseException as err:
            errors.append(err)

    with sqlite_db.writer() as session:
        session.execute(text("INSERT INTO t VALUES ('first')"))  # SQLite's lock is taken
        thread = threading.Thread(target=second, name="second")
        thread.start()
        _wait_until(lambda: turns.waiting == 1)
        # Waiting, and not inside SQLite: only the first writer has begun.
        assert begins == [threading.current_thread().name]
        session.commit()
    thread.join()
    assert errors == []
    assert begins[-1] == "second"
    assert turns.wait_seconds > 0  # the second writer's wait, counted
    with sqlite_db.reader() as session:
        assert session.execute(text("SELECT writer FROM t ORDER BY rowid")).scalars().all() == [
            "first",
            "second",
        ]


def test_no_turn_within_the_wait_is_a_one_line_database_error(sqlite_db: Database) -> None:
    # Not reentrant: a nested writer of the same thread waits out the timeout.
    busy = r"^database busy: no write turn within 0\.05 s$"
    with sqlite_db.writer(), pytest.raises(DatabaseError, match=busy), sqlite_db.writer():
        pass
    assert sqlite_db.write_turns is not None and sqlite_db.write_turns.waiting == 0


def test_a_writer_with_less_time_than_the_timeout_gives_up_at_its_own_wait(
    tmp_path: Path,
) -> None:
    db = create_database(f"sqlite:///{tmp_path / 'wait.db'}", sqlite_busy_timeout_seconds=30)
    try:
        with db.writer():
            began = time.monotonic()
            with pytest.raises(WaitTimeout) as caught, db.writer(wait_seconds=0.05):
                pass
            assert time.monotonic() - began < 5, "waited for the 30 s timeout"
        assert is_wait_timeout(caught.value) and is_unavailable(caught.value)
        with db.writer(wait_seconds=0.05) as session:  # free: no wait at all
            session.execute(text("SELECT 1"))
    finally:
        db.dispose()


def test_a_failed_writer_gives_its_turn_back_and_keeps_nothing(sqlite_db: Database) -> None:
    with pytest.raises(RuntimeError), sqlite_db.writer() as session:
        session.execute(text("INSERT INTO t VALUES ('lost')"))
        raise RuntimeError("the request failed")
    with sqlite_db.writer() as session:  # at once: the turn was released
        session.execute(text("INSERT INTO t VALUES ('kept')"))
        session.commit()
    with sqlite_db.reader() as session:
        assert session.execute(text("SELECT writer FROM t")).scalars().all() == ["kept"]


def test_wrappers_of_one_engine_share_its_turns(sqlite_db: Database) -> None:
    other = Database.from_engine(sqlite_db.engine)
    assert other.write_turns is sqlite_db.write_turns
    with sqlite_db.writer(), pytest.raises(DatabaseError, match="no write turn"), other.writer():
        pass


def test_held_time_counts_each_turn_from_taking_it_to_giving_it_back() -> None:
    clock = FakeClock()
    turns = WriteTurns(timeout_seconds=0.05, clock=clock)
    with turns.turn():
        clock.advance(2.5)
    clock.advance(60.0)  # between turns: the writer is idle, not counted
    with pytest.raises(RuntimeError), turns.turn():
        clock.advance(0.25)
        raise RuntimeError("a failed writer held its turn too")
    assert turns.held_seconds == 2.75
    assert turns.wait_seconds == 0.0  # every turn was free when asked for

    with turns.turn(), pytest.raises(DatabaseError), turns.turn():  # refused: held nothing
        pass
    assert turns.held_seconds == 2.75


def test_the_store_busy_past_its_own_timeout_is_an_outage_not_the_callers_wait() -> None:
    turns = WriteTurns(timeout_seconds=0.05)
    with turns.turn(), pytest.raises(DatabaseError) as caught, turns.turn(wait_seconds=10.0):
        pass
    assert not is_wait_timeout(caught.value)


@pytest.mark.postgres
def test_postgres_writers_do_not_take_turns(postgres_url: str) -> None:
    db = create_database(postgres_url)
    try:
        assert db.write_turns is None
        with db.begin_write() as conn:
            conn.execute(text("CREATE TABLE t (writer TEXT)"))
        with db.writer() as first, db.writer() as second:  # concurrently, both commit
            first.execute(text("INSERT INTO t VALUES ('first')"))
            second.execute(text("INSERT INTO t VALUES ('second')"))
            second.commit()
            first.commit()
        with db.reader() as session:
            assert session.execute(text("SELECT count(*) FROM t")).scalar() == 2
    finally:
        db.dispose()


@pytest.mark.postgres
def test_a_postgres_writer_waits_for_a_row_lock_no_longer_than_its_wait(postgres_url: str) -> None:
    db = create_database(postgres_url)
    try:
        with db.begin_write() as conn:
            conn.execute(text("CREATE TABLE IF NOT EXISTS lock_probe (id INT PRIMARY KEY)"))
            conn.execute(text("INSERT INTO lock_probe VALUES (1) ON CONFLICT DO NOTHING"))
        with db.writer() as holder:
            holder.execute(text("SELECT id FROM lock_probe WHERE id = 1 FOR UPDATE"))
            began = time.monotonic()
            with pytest.raises(Exception) as caught, db.writer(wait_seconds=0.1) as waiter:
                waiter.execute(text("SELECT id FROM lock_probe WHERE id = 1 FOR UPDATE"))
            assert time.monotonic() - began < 5
            assert is_wait_timeout(caught.value)
            holder.rollback()
        with db.writer(wait_seconds=0.1) as free:  # the limit ends with its transaction
            free.execute(text("SELECT id FROM lock_probe WHERE id = 1 FOR UPDATE"))
            assert free.execute(text("SHOW lock_timeout")).scalar() == "100ms"
            free.commit()
            assert free.execute(text("SHOW lock_timeout")).scalar() == "0"
    finally:
        with db.begin_write() as conn:
            conn.execute(text("DROP TABLE IF EXISTS lock_probe"))
        db.dispose()
