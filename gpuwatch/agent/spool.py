"""The on-disk spool: snapshots wait here, durably, until the server acknowledges them.

One file per snapshot, named by a growing record number (``00000000000000000042.json``),
holding the snapshot's JSON. A record is written to ``<n>.tmp``, fsync'd, renamed into
place and the directory fsync'd, so after a crash a record is either complete under
its final name or absent; a ``.tmp`` left behind is a write that never finished.
Acknowledging a record deletes its file: there is no separate ledger that could
disagree with the files (the failure behind vectordotdev/vector#25570).

Bound: the bytes of pending records stay under ``max_bytes``; past it the oldest
records are deleted first (fresh state matters more than old state for "GPU filling
up") and counted as ``spool_full``. Records handed out by :meth:`Spool.peek_batch` and
not yet acked, dropped or released are in flight and are never evicted, so a record
the server may already hold is not also counted as dropped; the spool can therefore
exceed its bound by at most the batch in flight.

A full disk: when the filesystem refuses a write for want of space (``ENOSPC``,
``EDQUOT``) before ``max_bytes`` is reached, the oldest records not in flight are
evicted, counted as ``spool_full``, and the write is tried once more, so a disk smaller
than the bound keeps the newest snapshots, as the bound does. A directory removed under
the running agent (tmpfiles cleanup, an operator "clearing the spool") is created again
on the next write; the records it held are counted as ``corrupt`` when the drain finds
them gone.

Every record ends in exactly one place: acked, or counted in :meth:`Spool.dropped`
under a reason (``spool_full``, ``corrupt``, or whatever the caller passes to
:meth:`Spool.drop` or :meth:`Spool.count_dropped`). Those counters cover this process's
lifetime, like Prometheus counters. The drops of every run are also added up in the
file ``dropped_total`` in the directory (:meth:`Spool.dropped_ever`), which the agent
reports to the server: an agent restarted during an outage would otherwise never report
what an earlier run dropped. That total starts again from 0 only when the file (or the
directory) is removed. It is written after each operation that dropped something,
without an fsync: a crash may lose the last few counts, never a record.

One consumer and any number of producers in one process. Two processes must not share
a directory: each numbers records from the highest it finds, so they would overwrite and
delete each other's. The spool holds an exclusive lock on ``agent.lock`` in the
directory while open (a POSIX record lock, released by the kernel when the process
dies), and a second agent on the same directory is refused at start
(:class:`~gpuwatch.errors.ConfigError`, exit 3) with the pid of the first. The lock is
per process: a second :class:`Spool` in the same process (a test reopening a directory)
shares it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from gpuwatch.errors import ConfigError
from gpuwatch.snapshot import HostSnapshot

log = logging.getLogger(__name__)

_SUFFIX = ".json"
_TMP_SUFFIX = ".tmp"
_NAME_DIGITS = 20
LOCK_NAME = "agent.lock"
DROPPED_NAME = "dropped_total"
# The disk refused the write for want of room: evicting old records makes some.
_NO_ROOM = frozenset({errno.ENOSPC, errno.EDQUOT})


def encode(snapshot: HostSnapshot) -> bytes:
    """A snapshot as the spool stores it and the reporter sends it.

    Unknown (None) fields are left out: the server reads a missing field as None, the
    body is smaller, and a server older than this agent still takes its snapshots as
    long as the fields it does not know are unknown here (e.g. GPM figures on a board
    without GPM)."""
    return snapshot.model_dump_json(exclude_none=True).encode()


@dataclass(frozen=True)
class SpooledSnapshot:
    """One pending record: its number in the spool and the snapshot as UTF-8 JSON."""

    record_id: int
    body: bytes


@dataclass
class _Entry:
    size_bytes: int
    enqueued_at: float  # epoch seconds, from the spool's clock (kept as the file's mtime)


class Spool:
    """A bounded, crash-safe FIFO of snapshots in ``directory``.

    ``max_bytes`` bounds the bytes of pending records (file contents; directory
    overhead is not counted). ``clock`` gives Unix epoch seconds and stamps each
    record's enqueue time, for :meth:`oldest_age_seconds`.

    Raises :class:`~gpuwatch.errors.ConfigError` if the directory cannot be created or
    read. :meth:`append` raises :class:`OSError` when the disk refuses the write; the
    caller decides how to count that.
    """

    def __init__(
        self, directory: Path, *, max_bytes: int, clock: Callable[[], float] = time.time
    ) -> None:
        self._dir = directory
        self._max_bytes = max_bytes
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: dict[int, _Entry] = {}  # insertion order == record order
        self._in_flight: set[int] = set()
        self._total_bytes = 0
        self._dropped: Counter[str] = Counter()
        self._lock_fd: int | None = None
        # Drops of earlier runs (the file DROPPED_NAME), and this run's as last written.
        self._dropped_before = 0
        self._dropped_written = 0
        try:
            # 0700: snapshots name users and their command lines.
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            self._take_lock()
            self._dropped_before = self._read_dropped_total()
            self._load()
        except OSError as err:
            self.close()
            raise ConfigError(f"cannot use spool directory {directory}: {err}") from err
        except ConfigError:
            self.close()
            raise
        self._next_id = max(self._entries, default=-1) + 1
        with self._lock:
            self._enforce_bound()
            self._persist_dropped()
        if self._entries:
            log.info("spool %s holds %s pending snapshots", directory, len(self._entries))

    # --- producer ------------------------------------------------------------------------

    def append(self, snapshot: HostSnapshot) -> None:
        """Write ``snapshot`` durably, then evict the oldest records past the bound."""
        self.append_encoded(encode(snapshot))

    def append_encoded(self, body: bytes) -> None:
        """:meth:`append` for a snapshot already encoded (:func:`encode`)."""
        with self._lock:
            if len(body) > self._max_bytes:
                # It could never fit; evicting everything else for it would not help.
                self._dropped["spool_full"] += 1
                return
            record_id = self._next_id
            self._next_id += 1
            enqueued_at = self._clock()
            try:
                self._write(record_id, body, enqueued_at)
            except OSError as err:
                # Made room or a directory again: one more try, else the caller counts it.
                if not self._recover(err, len(body)):
                    raise
                self._write(record_id, body, enqueued_at)
            finally:
                self._persist_dropped()
            self._entries[record_id] = _Entry(len(body), enqueued_at)
            self._total_bytes += len(body)
            self._enforce_bound()
            self._persist_dropped()

    def count_dropped(self, reason: str, n: int = 1) -> None:
        """Count ``n`` snapshots the caller dropped without spooling them (e.g. its
        in-memory queue overflowed while the disk refused writes) under ``reason``."""
        with self._lock:
            self._dropped[reason] += n
            self._persist_dropped()

    def close(self) -> None:
        """Release the directory's lock (the process exiting does too)."""
        fd, self._lock_fd = self._lock_fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)

    # --- consumer ------------------------------------------------------------------------

    def peek_batch(self, max_items: int, max_bytes: int) -> list[SpooledSnapshot]:
        """The oldest pending records, up to ``max_items`` and ``max_bytes`` of bodies.

        Always at least one record when any is pending, even if it alone is larger than
        ``max_bytes``, so an oversized record cannot wedge the queue. The records stay
        pending, and in flight, until :meth:`ack`, :meth:`drop` or :meth:`release`.
        Records that cannot be read back are deleted and counted as ``corrupt``.
        """
        batch: list[SpooledSnapshot] = []
        size = 0
        with self._lock:
            for record_id in list(self._entries):
                if len(batch) >= max_items:
                    break
                body = self._read(record_id)
                if body is None:
                    self._remove(record_id, reason="corrupt")
                    continue
                if batch and size + len(body) > max_bytes:
                    break
                batch.append(SpooledSnapshot(record_id, body))
                size += len(body)
                self._in_flight.add(record_id)
            self._persist_dropped()
        return batch

    def ack(self, batch: Sequence[SpooledSnapshot]) -> None:
        """The server stored these records: delete them."""
        with self._lock:
            for record in batch:
                self._remove(record.record_id, reason=None)
            self._fsync_dir()

    def drop(self, batch: Sequence[SpooledSnapshot], reason: str) -> None:
        """Delete these records undelivered and count them under ``reason``."""
        with self._lock:
            for record in batch:
                self._remove(record.record_id, reason=reason)
            self._fsync_dir()
            self._persist_dropped()

    def release(self, batch: Sequence[SpooledSnapshot]) -> None:
        """Sending failed: keep these records pending (and evictable) for a later try."""
        with self._lock:
            self._in_flight.difference_update(r.record_id for r in batch)
            self._enforce_bound()
            self._persist_dropped()

    # --- state ---------------------------------------------------------------------------

    def dropped(self) -> dict[str, int]:
        """Records deleted undelivered since this object was created, by reason."""
        with self._lock:
            return dict(self._dropped)

    def dropped_ever(self) -> int:
        """Snapshots dropped by every run on this directory, all reasons: what the
        agent reports to the server (see the module docstring for when it restarts)."""
        with self._lock:
            return self._dropped_before + self._dropped.total()

    def pending_count(self) -> int:
        with self._lock:
            return len(self._entries)

    def pending_bytes(self) -> int:
        with self._lock:
            return self._total_bytes

    def oldest_age_seconds(self) -> float | None:
        """Seconds since the oldest pending record was appended; ``None`` when empty."""
        with self._lock:
            oldest = next(iter(self._entries.values()), None)
            return None if oldest is None else max(0.0, self._clock() - oldest.enqueued_at)

    # --- files (called with the lock held) ----------------------------------------------

    def _path(self, record_id: int, suffix: str = _SUFFIX) -> Path:
        return self._dir / f"{record_id:0{_NAME_DIGITS}d}{suffix}"

    def _take_lock(self) -> None:
        """Lock the directory for this process; ConfigError when another agent holds it."""
        path = self._dir / LOCK_NAME
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            if err.errno not in (errno.EACCES, errno.EAGAIN):
                os.close(fd)
                raise
            try:
                other = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
            finally:
                os.close(fd)
            raise ConfigError(
                f"spool directory {self._dir} is in use by another gpuwatch agent (pid"
                f" {other}): give each agent its own spool_dir"
            ) from None
        # Locked: only now may the pid of the holder be replaced by ours.
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        previous, self._lock_fd = self._lock_fd, fd
        if previous is not None:
            with contextlib.suppress(OSError):
                os.close(previous)

    def _recover(self, err: OSError, needed: int) -> bool:
        """After a refused write: True when something was done that may let a second
        try succeed (the directory created again, or old records evicted for room)."""
        if err.errno == errno.ENOENT and not self._dir.is_dir():
            log.error("spool directory %s was removed: creating it again", self._dir)
            self._dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            # The lock went with the old directory: take it on the new one.
            self._take_lock()
            return True
        if err.errno in _NO_ROOM:
            return self._evict_for_room(needed) > 0
        return False

    def _evict_for_room(self, needed: int) -> int:
        """Evict the oldest records not in flight, counted ``spool_full``, until their
        bytes reach ``needed`` (at least one record, since a file takes a whole block
        however small); returns how many."""
        freed = evicted = 0
        for record_id in list(self._entries):
            if freed >= needed:
                break
            if record_id in self._in_flight:
                continue
            freed += self._entries[record_id].size_bytes
            self._remove(record_id, reason="spool_full")
            evicted += 1
        if evicted:
            log.warning(
                "spool filesystem %s is full: evicted the %d oldest snapshot(s) (counted as"
                " spool_full) to keep the newest",
                self._dir,
                evicted,
            )
        return evicted

    def _read_dropped_total(self) -> int:
        try:
            text = (self._dir / DROPPED_NAME).read_text().strip()
        except FileNotFoundError:
            return 0
        if not text.isdigit():
            log.warning("spool drop total %s unreadable; counting from 0", self._dir / DROPPED_NAME)
            return 0
        return int(text)

    def _persist_dropped(self) -> None:
        """Write the drop total of every run when it changed. Best effort: failing to
        write it (the disk full) must not fail what dropped the snapshots."""
        total = self._dropped.total()
        if total == self._dropped_written:
            return
        path, tmp = self._dir / DROPPED_NAME, self._dir / (DROPPED_NAME + _TMP_SUFFIX)
        try:
            tmp.write_text(f"{self._dropped_before + total}\n")
            os.replace(tmp, path)
        except OSError as err:
            log.debug("cannot write %s: %s", path, err)
            return
        self._dropped_written = total

    def _load(self) -> None:
        found: list[tuple[int, _Entry]] = []
        for path in self._dir.iterdir():
            if path.suffix == _TMP_SUFFIX and path.stem.isdigit():
                # A write cut short by a crash: it never became a record, but a snapshot
                # was lost with it, so it is counted rather than silently swept.
                path.unlink(missing_ok=True)
                self._dropped["corrupt"] += 1
                continue
            if path.suffix != _SUFFIX or not path.stem.isdigit():
                continue
            info = path.stat()
            found.append((int(path.stem), _Entry(info.st_size, info.st_mtime)))
        for record_id, entry in sorted(found, key=lambda item: item[0]):
            self._entries[record_id] = entry
            self._total_bytes += entry.size_bytes

    def _write(self, record_id: int, body: bytes, enqueued_at: float) -> None:
        tmp, final = self._path(record_id, _TMP_SUFFIX), self._path(record_id)
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                view = memoryview(body)
                while view:
                    view = view[os.write(fd, view) :]
                os.fsync(fd)
            finally:
                os.close(fd)
            # The mtime carries the enqueue time across restarts.
            os.utime(tmp, (enqueued_at, enqueued_at))
            os.replace(tmp, final)
        except OSError:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            raise
        self._fsync_dir()

    def _read(self, record_id: int) -> bytes | None:
        try:
            body = self._path(record_id).read_bytes()
            # Well-formed JSON object or nothing: a damaged file must not poison a batch.
            if isinstance(json.loads(body), dict):
                return body
        except (OSError, ValueError) as err:
            log.warning("spool record %s unreadable, dropped: %s", record_id, err)
            return None
        log.warning("spool record %s is not a snapshot object, dropped", record_id)
        return None

    def _remove(self, record_id: int, *, reason: str | None) -> None:
        entry = self._entries.pop(record_id, None)
        self._in_flight.discard(record_id)
        if entry is None:
            return
        self._total_bytes -= entry.size_bytes
        try:
            self._path(record_id).unlink(missing_ok=True)
        except OSError as err:
            # The record is forgotten here either way; if the file survives, a restart
            # resends it and the server's idempotent ingest stores it once.
            log.warning("cannot delete spool record %s: %s", record_id, err)
        if reason is not None:
            self._dropped[reason] += 1

    def _enforce_bound(self) -> None:
        if self._total_bytes <= self._max_bytes:
            return
        for record_id in list(self._entries):
            if self._total_bytes <= self._max_bytes:
                break
            if record_id not in self._in_flight:
                self._remove(record_id, reason="spool_full")
        self._fsync_dir()

    def _fsync_dir(self) -> None:
        # Makes the rename or unlink itself durable, not just the file's contents. Best
        # effort: some filesystems refuse fsync on a directory, and by now the rename
        # has happened, so failing the append would count a stored record as lost.
        try:
            fd = os.open(self._dir, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as err:
            log.debug("fsync of spool directory %s failed: %s", self._dir, err)


class MemoryQueue:
    """Snapshots kept in memory while the spool cannot write them: at most ``max_items``,
    the oldest dropped past that and counted through ``count_dropped(reason)`` (the
    spool's :meth:`Spool.count_dropped`, so the drop reaches the server's count).

    The same consumer interface as :class:`Spool` (``peek_batch``, ``ack``, ``drop``,
    ``release``); record numbers are negative, so they never meet the spool's. Lost if
    the agent stops: it is a stopgap for a disk that refuses writes while the server is
    up, not a second spool.
    """

    def __init__(self, max_items: int, count_dropped: Callable[[str], None]) -> None:
        self._max_items = max_items
        self._count_dropped = count_dropped
        self._lock = threading.Lock()
        self._queue: deque[SpooledSnapshot] = deque()
        self._in_flight: dict[int, SpooledSnapshot] = {}
        self._next_id = -1

    def put(self, body: bytes) -> None:
        with self._lock:
            self._queue.append(SpooledSnapshot(self._next_id, body))
            self._next_id -= 1
            self._trim()

    def take_idle(self) -> list[bytes] | None:
        """Every queued body, oldest first, removed from the queue; None while a batch of
        them is in flight (they must not be overtaken by their own copies)."""
        with self._lock:
            if self._in_flight:
                return None
            bodies = [record.body for record in self._queue]
            self._queue.clear()
            return bodies

    def put_back(self, bodies: Sequence[bytes]) -> None:
        """Return what :meth:`take_idle` took and could not place, at the front, in order."""
        with self._lock:
            for body in reversed(bodies):
                self._queue.appendleft(SpooledSnapshot(self._next_id, body))
                self._next_id -= 1

    def peek_batch(self, max_items: int, max_bytes: int) -> list[SpooledSnapshot]:
        batch: list[SpooledSnapshot] = []
        size = 0
        with self._lock:
            for record in self._queue:
                if len(batch) >= max_items or (batch and size + len(record.body) > max_bytes):
                    break
                if record.record_id in self._in_flight:
                    continue
                batch.append(record)
                size += len(record.body)
            for record in batch:
                self._in_flight[record.record_id] = record
        return batch

    def ack(self, batch: Sequence[SpooledSnapshot]) -> None:
        self._forget(batch)

    def drop(self, batch: Sequence[SpooledSnapshot], reason: str) -> None:
        for _ in self._forget(batch):
            self._count_dropped(reason)

    def release(self, batch: Sequence[SpooledSnapshot]) -> None:
        with self._lock:
            for record in batch:
                self._in_flight.pop(record.record_id, None)
            self._trim()

    def pending_count(self) -> int:
        with self._lock:
            return len(self._queue)

    def _trim(self) -> None:
        """Past the bound, drop the oldest not in flight (one in flight may be stored
        already, and must not also count as dropped). Called with the lock held."""
        excess = len(self._queue) - self._max_items
        if excess <= 0:
            return
        dropped = [r for r in self._queue if r.record_id not in self._in_flight][:excess]
        ids = {r.record_id for r in dropped}
        self._queue = deque(r for r in self._queue if r.record_id not in ids)
        for _ in dropped:
            self._count_dropped("write_failed")

    def _forget(self, batch: Sequence[SpooledSnapshot]) -> list[SpooledSnapshot]:
        ids = {record.record_id for record in batch}
        with self._lock:
            gone = [record for record in self._queue if record.record_id in ids]
            self._queue = deque(r for r in self._queue if r.record_id not in ids)
            for record_id in ids:
                self._in_flight.pop(record_id, None)
        return gone
