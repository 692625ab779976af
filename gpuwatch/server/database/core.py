"""The one owner of the database binding: engine factory, declarative base, sessions.

SQLite (the default) and Postgres are both first-class. On SQLite every connection gets
``journal_mode=WAL`` (readers never block the writer), ``synchronous=NORMAL`` (a commit
survives an application crash; see docs/server.md for power loss), ``foreign_keys=ON``
and a ``busy_timeout``. pysqlite's own transaction handling is switched off and we emit
``BEGIN`` ourselves, so that write sessions start with ``BEGIN IMMEDIATE``: a deferred
transaction that reads and then writes can fail with ``SQLITE_BUSY_SNAPSHOT`` no matter
the busy timeout, while an immediate one queues for the write lock up front. Within one
process, writers first take turns on a lock (:class:`WriteTurns`), which wakes the next
one as soon as the lock is free, where SQLite's busy handler sleeps.

Nothing here runs at import; :func:`create_database` is called by the app factory,
the CLI and tests, each with its own settings.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
import secrets
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from sqlalchemy import (
    BigInteger,
    Connection,
    Engine,
    Integer,
    MetaData,
    create_engine,
    event,
    exc,
    func,
    select,
    text,
)
from sqlalchemy.engine import ExceptionContext, make_url
from sqlalchemy.orm import DeclarativeBase, Session, sessionmaker

from gpuwatch.errors import DatabaseError
from gpuwatch.settings import ServerSettings

# Explicit constraint names, so migrations can refer to them on both databases.
NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

# BIGINT on Postgres; on SQLite only a column typed exactly INTEGER aliases the rowid
# and autoincrements, so the variant keeps primary keys working there.
IdType = BigInteger().with_variant(Integer(), "sqlite")

# Free space Postgres leaves in each page of a table whose rows ingest rewrites on every
# push (``WITH (fillfactor = N)``): an updated row whose indexed columns did not change
# then fits on its own page, a HOT update that adds no index entries and whose old
# version is pruned in place. At the default (100) a full page sends the new version to
# another page, with a new entry in every index, and the table and its indexes bloat
# faster than autovacuum reclaims them. 150 hosts pushing 8-GPU, 50-process snapshots
# for 28 rounds (bench/fillfactor.py): HOT updates of lifetimes 35 % -> 96 %, Postgres's
# CPU a snapshot 0.64x, these tables 0.25x the bytes. Rows never updated again (ended
# lifetimes) do cost 1/fillfactor of their size. Samples tables are insert-only and keep
# the default.
FILLFACTOR = {
    "hosts": 50,  # one small row per host
    "gpus": 50,  # one small row per GPU
    "process_lifetimes": 70,  # every open lifetime, every push; ended rows stay put
    "process_windows": 70,  # rewritten once per sample interval
    "gpu_windows": 70,
}


def rewritten_in_place(table: str) -> dict[str, Any]:
    """The table options of ``table``, one of :data:`FILLFACTOR` (Postgres only)."""
    return {"postgresql_with": {"fillfactor": FILLFACTOR[table]}}


# Execution option that marks a write session (see module docstring).
_WRITE_OPTION = "gpuwatch_write"


class Base(DeclarativeBase):
    """Declarative base of every gpuwatch table."""

    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class WaitTimeout(DatabaseError):
    """The caller's own wait limit passed before its write turn came (SQLite): not an
    outage, the caller had no more time to give."""


class SlotTimeout(WaitTimeout):
    """No pooled connection of the session's kind came within its wait (see
    :data:`READ_CONNECTIONS`): the database is busy, not down (answered 503)."""


class UnusableDatabaseUrl(DatabaseError):
    """The database URL names nothing gpuwatch can use: a malformed URL, an engine it does
    not support, a driver not installed. A configuration mistake, not an outage (exit 3,
    which the units do not retry for 20 minutes as they do exit 7)."""

    exit_code = 3


def _url_hint(parsed: Any, err: Exception) -> str:
    """What to do about an unusable URL, when the cause says it."""
    backend = parsed.get_backend_name() if parsed is not None else ""
    if backend == "postgres":
        return "; write postgresql+psycopg://USER@HOST/DB"
    if backend == "postgresql" and isinstance(err, ImportError):
        return "; the Postgres driver is not installed: pip install 'gpuwatch-oom[postgres]'"
    if backend not in ("", "sqlite", "postgresql"):
        return "; gpuwatch supports sqlite:///PATH and postgresql+psycopg://USER@HOST/DB"
    return ""


class NoDatabase(DatabaseError):
    """A command that only uses an existing database found no SQLite file at its path
    (it is never created there: a mistyped path must not leave an empty database)."""

    def __init__(self, path: str) -> None:
        super().__init__(
            f"no database at {path} (`gpuwatch db upgrade` or `gpuwatch server` creates one)"
        )
        self.path = path


class WriteHealth:
    """Whether this process's writes are failing because the database cannot be
    written (read-only, disk full, I/O errors, a role without write permission:
    :func:`is_unwritable`).

    Reads keep working then, so a read alone (/healthz, the scrape) would call such a
    database healthy while every push is refused. A failed write sets the failure; only
    a write of a push's size that succeeds clears it (:meth:`Database.write_failure`
    tries one, :func:`probe_write_room`): a write that changes nothing fits where a
    push does not (a nearly full disk). Successful commits of other writers do not
    clear it, since one may have written next to nothing.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._failure: str | None = None
        self._probing = threading.local()

    @property
    def failure(self) -> str | None:
        """Why the last failed write failed, while no write has succeeded since."""
        return self._failure

    @property
    def probing(self) -> bool:
        """True in the thread running :meth:`Database.write_failure`'s probe."""
        return getattr(self._probing, "on", False)

    @contextmanager
    def probe(self) -> Iterator[None]:
        self._probing.on = True
        try:
            yield
        finally:
            self._probing.on = False

    def failed(self, reason: str) -> None:
        with self._lock:
            self._failure = reason

    def succeeded(self) -> None:
        with self._lock:
            self._failure = None


class WriteTurns:
    """SQLite admits one writer at a time; this process's writers take turns here first.

    A writer that finds SQLite's lock taken waits in its busy handler, which sleeps in
    steps of up to 100 ms and so keeps sleeping after the lock is free. A thread
    waiting here instead wakes the moment the writer before it is done. Writers in
    other processes (a separate scheduler, the CLI) still queue on the busy timeout.
    """

    def __init__(
        self, timeout_seconds: float, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.timeout_seconds = timeout_seconds
        self._clock = clock
        self._lock = threading.Lock()
        self._count = threading.Lock()
        self._waiting = 0
        self._waited = 0.0
        self._held = 0.0

    @property
    def waiting(self) -> int:
        """Writers of this process waiting for their turn now."""
        return self._waiting

    @property
    def wait_seconds(self) -> float:
        """Seconds writers of this process have spent waiting for a turn, in all (a
        counter: its rate is the average number of writers waiting)."""
        return self._waited

    @property
    def held_seconds(self) -> float:
        """Seconds writers of this process have held a turn, in all (a counter: its rate
        is the share of time this process keeps SQLite's one writer busy)."""
        return self._held

    @contextmanager
    def turn(self, wait_seconds: float | None = None) -> Iterator[None]:
        """Hold the process's write turn; :class:`DatabaseError` after the timeout, or
        :class:`WaitTimeout` after ``wait_seconds`` when that is sooner.

        Not reentrant: a thread that opens a second writer while holding one would
        deadlock on SQLite's lock anyway, and here it gets the timeout's error.
        """
        limit = self.timeout_seconds
        if wait_seconds is not None and wait_seconds < limit:
            limit = max(0.0, wait_seconds)
        with self._count:
            self._waiting += 1
        began = self._clock()
        try:
            got = self._lock.acquire(timeout=limit)
        finally:
            waited = self._clock() - began
            with self._count:
                self._waiting -= 1
                self._waited += waited
        if not got:
            if limit < self.timeout_seconds:
                raise WaitTimeout(f"no write turn within the {limit:.3g} s the writer had")
            raise DatabaseError(f"database busy: no write turn within {self.timeout_seconds:g} s")
        taken = self._clock()
        try:
            yield
        finally:
            # Added while the turn is still held: turns never overlap, so no other lock.
            self._held += self._clock() - taken
            self._lock.release()


# One set of turns per SQLite engine (its connection pool), however many Database
# wrappers share it: the app's and a test's, say.
_TURNS: weakref.WeakKeyDictionary[Engine, WriteTurns] = weakref.WeakKeyDictionary()

# The connection pool is split between readers and writers, so that reads can never
# hold ingest past its time budget. Without the split, 100 concurrent heavy reads took
# every pooled connection and a push waited the pool's 30 s checkout timeout (not its
# 5 s budget) for one. Read sessions may hold at most READ_CONNECTIONS at once, write
# sessions at most WRITE_CONNECTIONS; together they are the pool's capacity
# (create_database: POOL_SIZE kept, the rest overflow), so a session that has its slot
# always finds a connection, and every wait is here, where it is bounded: a read waits
# at most READ_WAIT_SECONDS for a slot (then DatabaseError: answered 503 with
# Retry-After), a writer at most its own ``wait_seconds`` (the push's deadline).
POOL_SIZE = 5
READ_CONNECTIONS = 10
WRITE_CONNECTIONS = 5
READ_WAIT_SECONDS = 5.0


@dataclass(frozen=True)
class ConnectionSlots:
    """The read and write slots of one engine (its pool), shared by its wrappers."""

    reads: threading.BoundedSemaphore
    writes: threading.BoundedSemaphore

    @classmethod
    def new(cls) -> ConnectionSlots:
        return cls(
            threading.BoundedSemaphore(READ_CONNECTIONS),
            threading.BoundedSemaphore(WRITE_CONNECTIONS),
        )


_SLOTS: weakref.WeakKeyDictionary[Engine, ConnectionSlots] = weakref.WeakKeyDictionary()
_WRITE_HEALTH: weakref.WeakKeyDictionary[Engine, WriteHealth] = weakref.WeakKeyDictionary()


@contextmanager
def _slot(semaphore: threading.BoundedSemaphore, wait_seconds: float, what: str) -> Iterator[None]:
    if not semaphore.acquire(timeout=max(0.0, wait_seconds)):
        raise SlotTimeout(f"database busy: no {what} connection free within {wait_seconds:.3g} s")
    try:
        yield
    finally:
        semaphore.release()


@dataclass(frozen=True)
class Database:
    """An engine plus the two kinds of session the server uses.

    ``writer()`` sessions begin with ``BEGIN IMMEDIATE`` on SQLite, one at a time: in
    this process they take turns (:class:`WriteTurns`), across processes SQLite's
    ``busy_timeout`` queues them. ``reader()`` sessions begin deferred, so reads run
    concurrently with the writer under WAL. On Postgres both are ordinary READ
    COMMITTED sessions, and writers run concurrently.
    """

    engine: Engine
    _readers: sessionmaker[Session]
    _writers: sessionmaker[Session]
    _turns: WriteTurns | None
    _slots: ConnectionSlots
    _write_health: WriteHealth

    @classmethod
    def from_engine(cls, engine: Engine, *, write_wait_seconds: float = 5.0) -> Database:
        """Wrap an engine (installing the SQLite hooks if it lacks them). On SQLite a
        writer waits up to ``write_wait_seconds`` for its turn in this process; the
        first wrapper of an engine sets that for all of them."""
        _install_sqlite_hooks(engine)
        health = _WRITE_HEALTH.setdefault(engine, WriteHealth())
        _discard_unwritable_connections(engine, health)
        turns = None
        if engine.dialect.name == "sqlite":
            turns = _TURNS.setdefault(engine, WriteTurns(write_wait_seconds))
        return cls(
            engine=engine,
            _readers=sessionmaker(bind=engine, expire_on_commit=False),
            _writers=sessionmaker(
                bind=engine.execution_options(**{_WRITE_OPTION: True}), expire_on_commit=False
            ),
            _turns=turns,
            _slots=_SLOTS.setdefault(engine, ConnectionSlots.new()),
            _write_health=health,
        )

    @contextmanager
    def reader(self, *, for_ingest: bool = False) -> Iterator[Session]:
        """A read session, once one of the read slots is free (at most
        :data:`READ_WAIT_SECONDS`; then :class:`SlotTimeout`, a 503).

        ``for_ingest``: a read a push needs before its write (its token check) takes a
        slot of the writers' share instead, so reads cannot hold it up either.
        """
        slots, what = (self._slots.writes, "write") if for_ingest else (self._slots.reads, "read")
        with _slot(slots, READ_WAIT_SECONDS, what), self._readers() as session:
            yield session

    @property
    def write_turns(self) -> WriteTurns | None:
        """The in-process write turns (SQLite), or None (Postgres: writers run at once)."""
        return self._turns

    @property
    def dialect(self) -> str:
        """``"sqlite"`` or ``"postgresql"``."""
        return self.engine.dialect.name

    @property
    def location(self) -> str:
        """Where the database is, for messages: the SQLite file, or the URL without its
        password."""
        url = self.engine.url
        if url.get_backend_name() == "sqlite" and url.database:
            return url.database if _is_uri(url.query) else os.path.abspath(url.database)
        return url.render_as_string(hide_password=True)

    def write_failure(self, *, wait_seconds: float = 1.0) -> str | None:
        """None while the database takes writes; else why it does not.

        Only after a write of this process failed for want of a writable database
        (:class:`WriteHealth`): then it tries a write of a push's size that leaves
        nothing behind (:func:`probe_write_room`, waiting at most ``wait_seconds`` for
        its turn), and the failure stands until one succeeds. Otherwise it costs
        nothing.
        """
        if self._write_health.failure is None:
            return None
        # Twice at most: a probe refused for want of a writable database has its
        # connection discarded and the pool's other connections recycled (see
        # _discard_unwritable_connections), so a second try runs in a session opened
        # now, not in one that kept a read-only default since.
        for attempt in (1, 2):
            try:
                with self._write_health.probe(), self.writer(wait_seconds=wait_seconds) as session:
                    probe_write_room(session.connection())
                    session.commit()
            except WaitTimeout:
                break  # busy, not read-only: the failure stands until a write gets through
            except (exc.SQLAlchemyError, DatabaseError) as err:
                # writer() recorded it if it was unwritable
                if attempt == 1 and is_unwritable(err) and self.dialect == "postgresql":
                    continue
                break
            else:
                self._write_health.succeeded()
                break
        return self._write_health.failure

    @contextmanager
    def _watching_writes(self) -> Iterator[None]:
        try:
            yield
        except BaseException as err:
            if is_unwritable(err):
                self._write_health.failed(describe(err))
            raise

    @contextmanager
    def writer(
        self, *, wait_seconds: float | None = None, slot_seconds: float | None = None
    ) -> Iterator[Session]:
        """A write session, closed (rolled back unless committed) on the way out,
        before the next writer of this process gets its turn.

        ``wait_seconds`` bounds how long it may wait for others: for its turn on SQLite
        (:class:`WaitTimeout`), for a pooled connection (:class:`SlotTimeout`), for any
        row lock in its transaction on Postgres (``lock_timeout``; the error answers
        :func:`is_wait_timeout`). ``slot_seconds``, when given, bounds the wait for the
        connection alone (the ingest writer's deadline, where it sets no lock timeout).
        """
        turn = nullcontext() if self._turns is None else self._turns.turn(wait_seconds)
        # The turn first: on SQLite a writer holds a connection only during its turn.
        # Its slot (a pooled connection sure to be free) within the same wait, so a
        # push never waits on the pool past its deadline.
        slot_wait = self._turns.timeout_seconds if self._turns else READ_WAIT_SECONDS
        for bound in (wait_seconds, slot_seconds):
            if bound is not None:
                slot_wait = min(slot_wait, bound)
        began = time.monotonic()
        with turn:
            slot_wait -= time.monotonic() - began
            with (
                _slot(self._slots.writes, slot_wait, "write"),
                self._watching_writes(),
                self._writers() as session,
            ):
                if wait_seconds is not None and self._turns is None:
                    # At least 1 ms: a lock_timeout of 0 means no limit at all.
                    limit = f"{max(1, math.ceil(wait_seconds * 1000))}ms"
                    session.execute(select(func.set_config("lock_timeout", limit, True)))
                yield session

    @contextmanager
    def begin_write(self) -> Iterator[Connection]:
        """A connection in a write transaction (``BEGIN IMMEDIATE`` on SQLite),
        committed on success."""
        slot = _slot(self._slots.writes, READ_WAIT_SECONDS, "write")
        with (
            self._turn(),
            slot,
            self._watching_writes(),
            self.engine.execution_options(**{_WRITE_OPTION: True}).begin() as conn,
        ):
            yield conn

    def _turn(self) -> AbstractContextManager[None]:
        return nullcontext() if self._turns is None else self._turns.turn()

    def dispose(self) -> None:
        self.engine.dispose()


def create_database(
    url: str, *, sqlite_busy_timeout_seconds: float = 5.0, create: bool = True
) -> Database:
    """Build the engine and session factories for ``url``; connects lazily.

    Raises :class:`UnusableDatabaseUrl` for a URL SQLAlchemy cannot use (unknown driver,
    malformed URL, a port that is not a number) and for SQLite in memory, which a
    multi-connection server cannot share. A SQLite file is created on first connection
    when ``create`` (its directory must exist); without it, a missing file is
    :class:`NoDatabase`, and connections never create one.
    """
    try:
        parsed = make_url(url)
        backend = parsed.get_backend_name()
        if backend == "sqlite":
            database = parsed.database
            if database is None or database in ("", ":memory:"):
                raise DatabaseError("an in-memory SQLite database cannot be shared; give a file")
            uri = _is_uri(parsed.query)
            if uri and not create and "mode" not in parsed.query:
                # Opened read-write, never created (SQLite's default is ``mode=rwc``):
                # a mistyped path must not leave an empty database behind.
                parsed = parsed.update_query_dict({"mode": "rw"})
            engine = create_engine(
                parsed, connect_args={"timeout": sqlite_busy_timeout_seconds}, **_POOL
            )
            if not uri:
                _check_sqlite_file(engine, os.path.abspath(database), create=create)
        else:
            connect_args: dict[str, Any] = {}
            if backend == "postgresql" and parsed.get_driver_name() == "psycopg":
                # Fail fast when Postgres is down, so ingest can answer 503 promptly.
                connect_args["connect_timeout"] = 5
            engine = create_engine(parsed, connect_args=connect_args, **_POOL)
            _ping_when_idle(engine)
    except (exc.ArgumentError, exc.NoSuchModuleError, ImportError, ValueError) as err:
        # ValueError: a port that is not a number (``host:notaport``, ``[::1``), or a
        # query argument of the wrong type.
        try:
            hint = _url_hint(make_url(url), err)
        except (exc.ArgumentError, ValueError):  # the URL that failed fails here too
            hint = ""
        raise UnusableDatabaseUrl(f"unusable database URL {_safe(url)}: {err}{hint}") from err
    return Database.from_engine(engine, write_wait_seconds=sqlite_busy_timeout_seconds)


def _is_uri(query: Any) -> bool:
    value = query.get("uri", "")
    values = value if isinstance(value, tuple) else (value,)
    return any(str(v).lower() in ("true", "1", "yes", "on") for v in values)


def _check_sqlite_file(engine: Engine, path: str, *, create: bool) -> None:
    """A clear error naming the path where SQLite would only say "unable to open
    database file"; and, without ``create``, connections that never create the file
    (``mode=rw``), so a mistyped path does not leave an empty database behind."""
    if os.path.isdir(path):
        # SQLite would only say "unable to open database file".
        raise DatabaseError(f"the database {path} is a directory, not a SQLite file")
    if create:
        directory = os.path.dirname(path)
        if not os.path.isdir(directory):
            raise DatabaseError(f"cannot create the database {path}: no directory {directory}")
        return
    if not os.path.exists(path):
        raise NoDatabase(path)
    uri = f"file:{quote(path, safe='/')}?mode=rw"

    def connect(_dialect: Any, _record: Any, cargs: list[Any], cparams: dict[str, Any]) -> None:
        cargs[:1] = [uri]
        cparams["uri"] = True

    event.listen(engine, "do_connect", connect)


# Room for every read and write slot (see READ_CONNECTIONS), so none waits in the pool.
_POOL: dict[str, Any] = {
    "pool_size": POOL_SIZE,
    "max_overflow": READ_CONNECTIONS + WRITE_CONNECTIONS - POOL_SIZE,
}


def database_for(settings: ServerSettings, *, create: bool = True) -> Database:
    """:func:`create_database` for the configured URL, creating the default data dir
    when ``create`` (commands that only use an existing database pass False)."""
    if settings.database_url is None and create:
        try:
            settings.data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        except OSError as err:
            raise DatabaseError(f"cannot create data directory {settings.data_dir}: {err}") from err
    return create_database(settings.resolved_database_url(), create=create)


def _sqlite_on_connect(dbapi_connection: Any, _record: Any) -> None:
    # Hand transaction control to _sqlite_on_begin. The busy timeout is the driver's
    # ``timeout`` connect argument (sqlite3_busy_timeout underneath).
    dbapi_connection.isolation_level = None
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.execute("PRAGMA foreign_keys=ON")
        files = [row[2] for row in cursor.execute("PRAGMA database_list") if row[1] == "main"]
    finally:
        cursor.close()
    for path in files:
        _owner_only(path)


def _owner_only(path: str) -> None:
    """Mode 0600 for a SQLite file of ours and its ``-wal``/``-shm``: they hold every
    user's command lines and the token hashes. Under the shipped units ``UMask=0077``
    does this; by hand, a umask of 022 or an existing 0755 directory would leave them
    world-readable. Another user's file (a shared database) is left as it is.

    Root's file in a directory another user owns (``gpuwatch db upgrade`` run as root
    in the service's state directory, before the service made the database) is handed
    to that owner: left root's 0600, the service could never open it."""
    if not path:
        return
    try:
        directory_owner = os.stat(os.path.dirname(os.path.abspath(path))).st_uid
    except OSError:
        directory_owner = None
    for name in (path, f"{path}-wal", f"{path}-shm"):
        try:
            info = os.stat(name)
            if info.st_uid == os.geteuid() and info.st_mode & 0o077:
                os.chmod(name, info.st_mode & 0o7700)
            if info.st_uid == 0 == os.geteuid() and directory_owner not in (None, 0):
                os.chown(name, directory_owner, -1)
        except OSError:
            continue  # not there (yet), or not ours to change


def _sqlite_on_begin(connection: Any) -> None:
    write = connection.get_execution_options().get(_WRITE_OPTION, False)
    connection.exec_driver_sql("BEGIN IMMEDIATE" if write else "BEGIN")


def _install_sqlite_hooks(engine: Engine) -> None:
    """Idempotent, so an engine a caller built and passes in can be adopted."""
    if engine.dialect.name != "sqlite" or event.contains(engine, "connect", _sqlite_on_connect):
        return
    event.listen(engine, "connect", _sqlite_on_connect)
    event.listen(engine, "begin", _sqlite_on_begin)


# A pooled connection idle at least this long is pinged before it is handed out.
PING_AFTER_IDLE_SECONDS = 1.0
_IDLE_SINCE = "gpuwatch_idle_since"


def _ping_when_idle(engine: Engine) -> None:
    """SQLAlchemy's ``pool_pre_ping``, but only for a connection that sat in the pool.

    The ping recycles connections the database dropped while they were idle (a restart,
    an idle timeout), so the first push after it is stored, not answered 503. Pinging
    on every checkout, as ``pool_pre_ping`` does, cost every ingest transaction a round
    trip (0.08 ms of psycopg's CPU and 0.16 ms of waiting, measured), although under
    load a connection is back in use within milliseconds. A connection that dies within
    the second after its last use fails its transaction instead: answered 503, the pool
    is recycled, and the agent's idempotent retry stores it."""

    def checkin(_dbapi_connection: Any, record: Any) -> None:
        record.info[_IDLE_SINCE] = time.monotonic()

    def checkout(dbapi_connection: Any, record: Any, _proxy: Any) -> None:
        since = record.info.pop(_IDLE_SINCE, None)
        if since is None or time.monotonic() - since < PING_AFTER_IDLE_SECONDS:
            return  # new, or back in use at once
        try:
            engine.dialect.do_ping(dbapi_connection)
        except Exception as err:
            # The pool then discards this connection and checks out (or opens) another.
            raise exc.DisconnectionError(describe(err)) from err

    event.listen(engine, "checkin", checkin)
    event.listen(engine, "checkout", checkout)


_LOCK_NOT_AVAILABLE = "55P03"  # Postgres's SQLSTATE for a lock_timeout


def is_wait_timeout(err: BaseException) -> bool:
    """True when ``err`` is a writer's own wait limit passing (see
    :meth:`Database.writer`): a SQLite turn or a Postgres row lock that did not come."""
    if isinstance(err, WaitTimeout):
        return True
    original = getattr(err, "orig", None)
    return getattr(original, "sqlstate", None) == _LOCK_NOT_AVAILABLE


def is_unavailable(err: BaseException) -> bool:
    """True when ``err`` means "the database cannot serve now": retrying later may work.

    Covers refused or dropped connections, a locked SQLite file past its busy timeout,
    a full disk, an unopenable file, an exhausted connection pool and a database that
    cannot be written (:func:`is_unwritable`: a Postgres standby says so with an
    ``InternalError``). Programming errors and constraint violations are not outages.
    """
    if isinstance(err, DatabaseError) or is_unwritable(err):
        return True
    if isinstance(err, exc.DBAPIError) and err.connection_invalidated:
        return True
    return isinstance(err, exc.OperationalError | exc.InterfaceError | exc.TimeoutError)


# SQLite primary result codes (the low byte of the extended code) that mean the file
# cannot be written: READONLY (a read-only file, directory or mount), IOERR, FULL
# (disk full), CANTOPEN, PERM. Postgres SQLSTATEs: a read-only transaction (a standby,
# ``default_transaction_read_only``), insufficient privilege (the role lost INSERT,
# UPDATE or DELETE), disk full, and any I/O error (class 58).
_SQLITE_UNWRITABLE = frozenset({3, 8, 10, 13, 14})
_PG_UNWRITABLE = ("25006", "42501", "53100", "58")


def is_unwritable(err: BaseException) -> bool:
    """True when ``err`` says the database cannot be written (as opposed to busy, or
    unreachable: those fail reads too)."""
    return _is_unwritable_driver_error(getattr(err, "orig", None))


def _is_unwritable_driver_error(original: object) -> bool:
    """:func:`is_unwritable` of the driver's own exception."""
    code = getattr(original, "sqlite_errorcode", None)
    if isinstance(code, int):
        return code & 0xFF in _SQLITE_UNWRITABLE
    sqlstate = getattr(original, "sqlstate", None)
    return isinstance(sqlstate, str) and sqlstate.startswith(_PG_UNWRITABLE)


def _discard_unwritable_connections(engine: Engine, health: WriteHealth) -> None:
    """Discard a connection whose statement failed for want of a writable database,
    so the pool opens a fresh session for the next one. Idempotent.

    A Postgres session keeps the defaults it started with: after ``ALTER DATABASE ...
    SET default_transaction_read_only = on`` and back ``off``, every pooled connection
    opened in between stays read-only, and a server that reused them answered 503 until
    restarted. The failing connection is always discarded; every other pooled one is
    recycled on its next checkout too (SQLAlchemy's pool invalidation) when the
    failure is new or the write that failed was :meth:`Database.write_failure`'s
    probe, so that recovery needs one probe, while a lasting outage does not reopen
    the pool on every refused push, only at the rate of /healthz and scrapes.

    Postgres only: a SQLite connection keeps no such state (a full disk or a read-only
    file is the file's), and closing one in the middle of its failed statement left
    the file locked until the garbage collector finalised it.
    """
    if engine.dialect.name != "postgresql" or engine in _handle_error_listeners:
        return

    def handle_error(context: ExceptionContext) -> None:
        if context.connection is None or context.is_pre_ping:
            return
        if not _is_unwritable_driver_error(context.original_exception):
            return
        context.is_disconnect = True
        context.invalidate_pool_on_disconnect = health.failure is None or health.probing

    _handle_error_listeners[engine] = handle_error
    event.listen(engine, "handle_error", handle_error)


_handle_error_listeners: weakref.WeakKeyDictionary[Engine, Callable[..., None]] = (
    weakref.WeakKeyDictionary()
)


def probe_write(conn: Connection) -> None:
    """A real write that changes nothing, so a database that can be read but not
    written fails here (SQLite opens a read-only file without complaint)."""
    conn.exec_driver_sql("UPDATE alembic_version SET version_num = version_num")


# What :func:`probe_write_room` writes: about what a large push writes (an 8-GPU,
# 50-process snapshot's rows, samples and windows: tens of KB of pages).
PROBE_WRITE_BYTES = 64 * 1024
# A hostname no agent can have (hostnames have no spaces), so a probe's row is never
# mistaken for a host, not even while it exists inside the probe's own transaction.
_PROBE_HOST = "gpuwatch write probe "


def probe_write_room(conn: Connection) -> None:
    """Write about a push's worth of data and delete it again, in the caller's
    transaction, which the caller commits: the database ends as it was, but the commit
    had to write those pages (SQLite: about 18 WAL frames; Postgres: the row's TOAST
    and WAL). A database that takes a write that changes nothing but not a push (a
    nearly full disk, where :func:`probe_write` still fits) fails here.

    The row is a ``hosts`` row under a name no agent has, unique to the probe (two
    probes never wait on each other's key), inserted and deleted in one transaction,
    so no other session ever sees it. Its filler is random (incompressible).
    """
    name = _PROBE_HOST + secrets.token_hex(8)
    conn.execute(
        text(
            "INSERT INTO hosts (hostname, created_at, pid_namespace_isolated, fake,"
            " spool_dropped_total, state_version, tiles, retired_at)"
            " VALUES (:name, 0, :no, :no, 0, 0, :filler, 0)"
        ),
        {"name": name, "no": False, "filler": secrets.token_hex(PROBE_WRITE_BYTES // 2)},
    )
    conn.execute(text("DELETE FROM hosts WHERE hostname = :name"), {"name": name})


@contextmanager
def translated_errors(what: str) -> Iterator[None]:
    """Turn SQLAlchemy errors into :class:`DatabaseError` (for the CLI and jobs)."""
    try:
        yield
    except exc.SQLAlchemyError as err:
        raise DatabaseError(f"{what}: {describe(err)}") from err


def describe(err: BaseException) -> str:
    """The first line of the driver's message, without SQLAlchemy's boilerplate."""
    original = getattr(err, "orig", None) or err
    text = str(original).strip().splitlines()
    return text[0] if text else type(original).__name__


def advisory_lock_key(name: str) -> int:
    """A stable signed 64-bit Postgres advisory-lock key for ``name``."""
    digest = hashlib.sha256(f"gpuwatch:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


def _safe(url: str) -> str:
    """``url`` with its password masked, also when SQLAlchemy cannot parse it."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except (exc.ArgumentError, ValueError):
        # Everything between the user's colon and the last "@" may be the password.
        return re.sub(r"^([^:/]*://[^:/@]*):.*@", r"\1:***@", url, flags=re.DOTALL)
