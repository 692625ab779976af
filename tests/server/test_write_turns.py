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
from gpuwatch.server.database.core import WriteTurns
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
