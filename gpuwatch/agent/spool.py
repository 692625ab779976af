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

Every record ends in exactly one place: acked, or counted in :meth:`Spool.dropped`
under a reason (``spool_full``, ``corrupt``, or whatever the caller passes to
:meth:`Spool.drop`). Counters cover this process's lifetime, like Prometheus counters.

One consumer and any number of producers in one process; two processes must not share
a directory.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from gpuwatch.errors import ConfigError
from gpuwatch.snapshot import HostSnapshot

log = logging.getLogger(__name__)

_SUFFIX = ".json"
_TMP_SUFFIX = ".tmp"
_NAME_DIGITS = 20


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
        try:
            # 0700: snapshots name users and their command lines.
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            self._load()
        except OSError as err:
            raise ConfigError(f"cannot use spool directory {directory}: {err}") from err
        self._next_id = max(self._entries, default=-1) + 1
        with self._lock:
            self._enforce_bound()
        if self._entries:
            log.info("spool %s holds %s pending snapshots", directory, len(self._entries))

    # --- producer ------------------------------------------------------------------------

    def append(self, snapshot: HostSnapshot) -> None:
        """Write ``snapshot`` durably, then evict the oldest records past the bound."""
        body = encode(snapshot)
        with self._lock:
            if len(body) > self._max_bytes:
                # It could never fit; evicting everything else for it would not help.
                self._dropped["spool_full"] += 1
                return
            record_id = self._next_id
            self._next_id += 1
            enqueued_at = self._clock()
            self._write(record_id, body, enqueued_at)
            self._entries[record_id] = _Entry(len(body), enqueued_at)
            self._total_bytes += len(body)
            self._enforce_bound()

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

    def release(self, batch: Sequence[SpooledSnapshot]) -> None:
        """Sending failed: keep these records pending (and evictable) for a later try."""
        with self._lock:
            self._in_flight.difference_update(r.record_id for r in batch)
            self._enforce_bound()

    # --- state ---------------------------------------------------------------------------

    def dropped(self) -> dict[str, int]:
        """Records deleted undelivered since this object was created, by reason."""
        with self._lock:
            return dict(self._dropped)

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
