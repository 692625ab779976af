"""The central server's history for the agent's automatic policy, at a bounded cost.

``gpuwatch reap`` asks the server once per run; the policy plans every
``check_interval`` for as long as the agent runs, so it asks through this cache:

* **Only candidates whose local history is too short.** The planner asks only about a
  process that every other check would reap, whose agent history shows nothing but
  quiet idleness and begins inside the window (after an agent restart); the same
  rules and the same :class:`~gpuwatch.agent.reaper.central.ServerHistory` as the
  command line (same process only, gaps unknown, the agent's own history wins).
* **At most once per** ``refresh_seconds`` **per process.** The answer (runs, or
  "nothing there") is kept that long; within it a check costs no request. It is asked
  again after that, so pushes the server got late (an agent's spool replayed) count.
* **Down is never idle.** A failure (unreachable, refused token, an unexpected answer)
  empties the cache and stops all asking until ``retry`` seconds have passed, doubling
  from ``retry_min_seconds`` to ``retry_max_seconds`` while failures go on; meanwhile
  the agent's history alone decides, so a process it has not watched for a whole
  window is not idle. The first failure of a streak is logged as a warning.
* **Bounded memory.** Entries older than ``refresh_seconds`` are dropped at each check,
  and at most ``max_entries`` are kept (oldest dropped first).

A request can block the poll loop for up to the reader's timeout; after a failure no
other request is made in that check, so a hung server costs one timeout per retry
period.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from gpuwatch.agent.reaper.central import ReadApi, ServerHistory, ServerLookup
from gpuwatch.agent.reaper.history import Run

log = logging.getLogger(__name__)

Key = tuple[str, str, int, int, float]  # (hostname, GPU uuid, GPU index, pid, start time)


@dataclass(frozen=True)
class _Entry:
    at: float
    runs: tuple[Run, ...] | None


@dataclass
class CacheStats:
    """What the cache did: answers from the server, from the cache, and failures."""

    asked: int = 0
    cached: int = 0
    failures: int = 0


class CachedServerHistory:
    """:meth:`for_check` gives the planner a :class:`ServerLookup` for one check."""

    def __init__(
        self,
        api: ReadApi,
        *,
        server_url: str,
        clock: Callable[[], float],
        refresh_seconds: float = 600.0,
        retry_min_seconds: float = 60.0,
        retry_max_seconds: float = 3600.0,
        max_entries: int = 4096,
    ) -> None:
        self._api = api
        self._url = server_url
        self._clock = clock
        self._refresh = refresh_seconds
        self._retry_min = retry_min_seconds
        self._retry_max = retry_max_seconds
        self._retry = retry_min_seconds
        self._max_entries = max_entries
        self._entries: dict[Key, _Entry] = {}
        self.retry_at = 0.0
        self.stats = CacheStats()

    def __len__(self) -> int:
        return len(self._entries)

    def for_check(self, hostname: str) -> ServerLookup:
        """The lookup for one plan of this host; answers ``None`` while backing off."""
        now = self._clock()
        self._entries = {k: e for k, e in self._entries.items() if now - e.at < self._refresh}
        failed: list[str] = []
        history = ServerHistory(
            self._api, hostname=hostname, server_url=self._url, note=failed.append
        )

        def lookup(
            *, gpu_index: int, gpu_uuid: str, pid: int, start_time: float, since: float
        ) -> list[Run] | None:
            key = (hostname, gpu_uuid, gpu_index, pid, start_time)
            entry = self._entries.get(key)
            if entry is not None:
                self.stats.cached += 1
                return _copy(entry.runs)
            if failed or now < self.retry_at:
                return None
            self.stats.asked += 1
            runs = history(
                gpu_index=gpu_index, gpu_uuid=gpu_uuid, pid=pid, start_time=start_time, since=since
            )
            if failed:
                self._back_off(now, failed[0])
                return None
            self._retry = self._retry_min
            self._keep(key, _Entry(now, None if runs is None else tuple(runs)))
            return runs

        return lookup

    def _keep(self, key: Key, entry: _Entry) -> None:
        self._entries[key] = entry
        while len(self._entries) > self._max_entries:
            del self._entries[min(self._entries, key=lambda k: self._entries[k].at)]

    def _back_off(self, now: float, why: str) -> None:
        self.stats.failures += 1
        if now >= self.retry_at and self._retry == self._retry_min:
            log.warning("reaper policy: %s; asking the server again in %.0fs", why, self._retry)
        self._entries.clear()  # only what the server says now may make a process idle
        self.retry_at = now + self._retry
        self._retry = min(self._retry * 2, self._retry_max)


def _copy(runs: tuple[Run, ...] | None) -> list[Run] | None:
    if runs is None:
        return None
    return [
        Run(r.start, r.end, r.activity, r.low_bytes, r.high_bytes, r.busiest_ratio, r.cpu_busy)
        for r in runs
    ]
