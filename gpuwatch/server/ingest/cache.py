"""Host state kept between ingest requests, valid only at the version it was stored.

Loading a host's GPUs, open lifetimes and open events was a fifth of a single-snapshot
push, and it runs inside the write transaction, where SQLite lets one request in at a
time. Each push reads the host row anyway (locking it), so that read also fetches
``hosts.state_version``; when the copy kept here carries the same version, nothing
else is read.

What makes a kept copy safe to use:

* Every writer of that state bumps the version in its own transaction: ingest
  (:meth:`~gpuwatch.server.ingest.state.HostState.flush`), the stale-lifetime job
  (the same flush) and the agent-silence job. A push that another replica stored, or
  a job that ran anywhere, makes the copy here stale, and it is read again.
* A copy is taken out of the cache when a request starts using it and put back only
  after that request committed, so a failed or rolled-back request leaves nothing
  behind, and two requests never share the objects.

Bounded (least recently used first out): about 40 KiB a host of 50 processes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from gpuwatch.server.lru import BoundedLru

if TYPE_CHECKING:
    from gpuwatch.server.events.book import EventRow
    from gpuwatch.server.ingest.state import GpuRow, HostRow, LifetimeRow


@dataclass(frozen=True)
class KeptState:
    """What :class:`~gpuwatch.server.ingest.state.HostState` reads besides the host
    row, as its last committed request left it (``version``: the host's then)."""

    version: int
    gpus: list[GpuRow]
    lifetimes: list[LifetimeRow]
    events: list[EventRow]
    windows: dict[int, bytes | None]
    gpu_windows: dict[int, bytes | None]

    @classmethod
    def of(
        cls,
        host: HostRow,
        gpus: list[GpuRow],
        lifetimes: list[LifetimeRow],
        events: list[EventRow],
        windows: dict[int, bytes | None],
        gpu_windows: dict[int, bytes | None],
    ) -> KeptState:
        open_ids = {lifetime.id for lifetime in lifetimes}
        return cls(
            version=host.state_version,
            gpus=gpus,
            lifetimes=lifetimes,
            events=events,
            # Windows of lifetimes that ended are never read again.
            windows={k: v for k, v in windows.items() if k in open_ids},
            gpu_windows=dict(gpu_windows),
        )


class HostStateCache(BoundedLru[int, KeptState]):
    """Host id -> :class:`KeptState`, least recently used forgotten first."""

    def take(self, host_id: int, version: int) -> KeptState | None:
        """Remove and return the host's copy if it is at ``version``; drop it if not."""
        kept = self.pop(host_id)
        return kept if kept is not None and kept.version == version else None
