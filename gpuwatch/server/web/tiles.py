"""The fleet page's reads: every host with its GPUs' tiles, and the header's totals.

Four small queries whatever the fleet size: the hosts (by name) with their tiles, the
JSON text ingest keeps on each host's row (gpuwatch/server/hosts/tiles.py: every GPU
with its fullness, largest holder and open flags); the GPUs per fullness bucket and the
memory held by open orphaned and idle events, both as ``/api/v1/fleet`` works them out
(the same functions); and the GPUs per combination of open flags. The page writes
markup per host, never per GPU: its script draws each host's tiles from the text
(static/dashboard.js).

At 8,000 GPUs, reading one row per GPU into Python values and writing a tile for each
were each about as long as the whole ``/api/v1/fleet`` summary (bench/dashboard.py).

A host is flagged when it is silent (here) or one of its GPUs has an open flag (by the
script, which reads the flags): the one open event about a host itself,
``agent_silent``, is its silence, which the page works out from the host's last report,
as the API does.

Sizes are bytes, times Unix epoch seconds (the agents' clocks, as stored), as in the
rest of the server.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from sqlalchemy import Connection, Select, func, literal_column, select
from sqlalchemy.orm import Session

from gpuwatch.server.fleet.service import gpus_by_fullness, held_bytes
from gpuwatch.server.hosts.models import GPU_FLAG_KINDS, Gpu, Host
from gpuwatch.server.hosts.service import silence_threshold_seconds
from gpuwatch.server.pagination import bytewise
from gpuwatch.settings import ServerSettings

# Event kinds a tile flags (an open event of the kind on that GPU), in the order of the
# bits of a tile's flag mask: bit ``i`` set means an open ``TILE_FLAGS[i]`` event.
TILE_FLAGS = GPU_FLAG_KINDS


class FleetHost(NamedTuple):
    """A host of the fleet page: its name, its silence, its tiles (hosts/tiles.py's
    JSON; None or ``[]`` when it has reported no GPU)."""

    hostname: str
    silent: bool
    tiles: str | None


class Fleet(NamedTuple):
    """Every host (by name) with its tiles, and the totals the page's header shows."""

    hosts: list[FleetHost]
    fullness: dict[str, int]  # GPUs per bucket of /api/v1/fleet
    held_bytes: dict[str, int]  # open orphaned / idle events' held memory
    flagged: dict[str, int]  # GPUs per flag
    silent_hosts: int

    @property
    def gpus(self) -> int:
        return sum(self.fullness.values())


def fleet_tiles(*, session: Session, settings: ServerSettings, now: float) -> Fleet:
    """Every host with its tiles, and the header's totals."""
    connection = session.connection()
    hosts = [
        FleetHost(
            hostname,
            received is None or received < now - silence_threshold_seconds(settings, interval),
            tiles,
        )
        for hostname, received, interval, tiles in _fetch(connection, _HOSTS)
    ]
    masks = _fetch(connection, _FLAGGED)  # (flag mask, GPUs) for each mask but 0
    return Fleet(
        hosts=hosts,
        fullness=gpus_by_fullness(session=session, settings=settings, now=now),
        held_bytes=held_bytes(session=session),
        flagged={
            kind: sum(n for mask, n in masks if mask & 1 << bit)
            for bit, kind in enumerate(TILE_FLAGS)
        },
        silent_hosts=sum(1 for host in hosts if host.silent),
    )


# Built once, and compiled once per dialect (:func:`_fetch`).
_HOSTS = (
    select(Host.hostname, Host.last_received_at, Host.push_interval_seconds, Host.tiles)
    .where(Host.retired_at.is_(None))
    .order_by(bytewise(Host.hostname))
)
_FLAGGED = (
    select(Gpu.open_flags, func.count())
    .where(Gpu.open_flags != literal_column("0"))
    .group_by(Gpu.open_flags)
)


def _fetch(connection: Connection, statement: Select[*tuple[Any, ...]]) -> Sequence[Any]:
    """The rows of one of this module's statements, as the driver's cursor returns them.

    SQLAlchemy's result handling, light as it is, cost 10 to 20% of fetching thousands
    of rows on SQLite. So the statement is compiled once per dialect, run as plain SQL
    on the session's connection (same transaction), and its rows taken from the DBAPI
    cursor. Only for statements without parameters whose columns need no type
    processing: ints, floats, strings, NULL.
    """
    key = (id(statement), connection.dialect.name)
    sql = _COMPILED.get(key)
    if sql is None:
        compiled = statement.compile(dialect=connection.dialect)
        assert not compiled.params, "only statements without parameters"
        sql = _COMPILED[key] = str(compiled)
    result = connection.exec_driver_sql(sql)
    try:
        return result.cursor.fetchall()  # type: ignore[no-any-return]
    finally:
        result.close()


_COMPILED: dict[tuple[int, str], str] = {}
