"""The fleet page's reads: every GPU of the fleet as one row, with its largest holder,
how many processes and users hold memory on it, and its open flags.

Three queries whatever the fleet size: the hosts (by name), the tiles (one row per GPU,
by host and index, with the holders and the open events' flags that ingest keeps on the
GPU's row), and the memory open orphaned and idle events hold (the header's, summed as
``/api/v1/fleet`` sums it). A host is flagged when it is silent or one of its GPUs is:
the one open event about a host itself, ``agent_silent``, is its silence, which the
page works out from the host's last report (as the API does). The tile rows are split by host with
``itertools.groupby`` and handed to the template as they came: the one Python loop
that does real work per tile is the one that writes it (and counts GPUs per fullness
bucket for the header as it goes, templates/fleet.py).

At 8,000 GPUs the page's time is mostly turning rows into Python values (about a
tenth of a microsecond each on SQLite), so the tile rows carry only what a tile shows:
the host's name and report time come once per host, not once per GPU, and a lost GPU
comes with no used memory (as if unread, which is how its tile shows it) rather than
with a boolean column to convert. The rows are fetched straight from the driver's
cursor (:func:`_fetch`).

Sizes are bytes, times Unix epoch seconds (the agents' clocks, as stored), as in the
rest of the server.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from itertools import groupby
from operator import itemgetter
from typing import Any, NamedTuple

from sqlalchemy import Connection, Select, case, select
from sqlalchemy.orm import Session

from gpuwatch.server.fleet.service import held_bytes
from gpuwatch.server.hosts.models import GPU_FLAG_KINDS, Gpu, Host
from gpuwatch.server.hosts.service import silence_threshold_seconds
from gpuwatch.settings import ServerSettings

# Event kinds a tile flags (an open event of the kind on that GPU), in the order of the
# bits of a tile's flag mask: bit ``i`` set means an open ``TILE_FLAGS[i]`` event.
TILE_FLAGS = GPU_FLAG_KINDS

# A tile row, as the tiles query returns it: the GPU's host (id), index, total and used
# bytes (used None: no current reading, or the GPU is lost); the owner of its largest
# process and that process's bytes (None when nobody holds memory there), how many
# processes and distinct users hold memory on it; its open events as a mask of
# TILE_FLAGS (0: none).
TILE_COLUMNS = ("host_id", "gpu_index", "total_bytes", "used_bytes", "user", "largest_bytes",
                "processes", "users", "flags")  # fmt: skip


class FleetHost(NamedTuple):
    """A host of the fleet page and its GPUs, each a row of :data:`TILE_COLUMNS`."""

    hostname: str
    silent: bool
    tiles: Sequence[Sequence[Any]]
    # Silent, or an open event on one of its GPUs.
    flagged: bool


class Fleet(NamedTuple):
    """Every host (by name) with its GPUs, and the totals the page's header shows."""

    hosts: list[FleetHost]
    gpus: int
    held_bytes: dict[str, int]  # open orphaned / idle events' held memory
    flagged: dict[str, int]  # GPUs per flag
    silent_hosts: int


class FleetRows(NamedTuple):
    """The fleet page's reads, as rows (see :func:`read_fleet`)."""

    hosts: Sequence[Sequence[Any]]  # id, hostname, last report (server clock); by name
    tiles: Sequence[Sequence[Any]]  # TILE_COLUMNS, one per GPU, by host id and index
    held_bytes: dict[str, int]  # open orphaned / idle events' held memory


def fleet_tiles(*, session: Session, settings: ServerSettings, now: float) -> Fleet:
    """Every GPU with its holders and open flags, and the header's totals."""
    return group_fleet(read_fleet(session=session), settings, now)


def read_fleet(*, session: Session) -> FleetRows:
    """What the fleet page shows: its hosts, one row per GPU, the held memory.

    Each GPU's holders and flags are read from its own row, where ingest keeps them
    (``gpus.holder_*`` and ``gpus.open_flags``, ingest/state.py): aggregating the
    50,000 open lifetimes of a 1,000-host fleet on every request was most of the page's
    time, and reading its 6,000 open events as rows to make the flags about a quarter
    of the rest (bench/dashboard.py). Rows come as plain tuples from the driver
    (:func:`_fetch`).
    """
    connection = session.connection()
    hosts = _fetch(connection, _HOSTS)
    tiles = _fetch(connection, _TILES)
    return FleetRows(hosts, tiles, held_bytes(session=session))


def group_fleet(rows: FleetRows, settings: ServerSettings, now: float) -> Fleet:
    """The tile rows of :func:`read_fleet` split by host (each host's rows stay as they
    came), and the page's totals. Per tile only its flags are looked at (to count GPUs
    per flag and find the hosts with flags); the rest is per host."""
    flagged_tiles = [tile for tile in rows.tiles if tile[_FLAGS]]
    shown = Counter(tile[_FLAGS] for tile in flagged_tiles)  # GPUs per flag mask
    flagged_hosts = {tile[0] for tile in flagged_tiles}
    by_host = {host_id: list(tiles) for host_id, tiles in groupby(rows.tiles, _HOST_ID)}
    reporting_since = now - silence_threshold_seconds(settings)
    hosts = []
    for host_id, hostname, received in rows.hosts:
        silent = received is None or received < reporting_since
        flagged = silent or host_id in flagged_hosts
        hosts.append(FleetHost(hostname, silent, by_host.get(host_id, _NO_TILES), flagged))
    flagged_gpus = {
        kind: sum(n for mask, n in shown.items() if mask & bit) for kind, bit in _BITS.items()
    }
    return Fleet(
        hosts=hosts,
        gpus=len(rows.tiles),
        held_bytes=rows.held_bytes,
        flagged=flagged_gpus,
        silent_hosts=sum(1 for host in hosts if host.silent),
    )


_HOST_ID = itemgetter(0)
_FLAGS = TILE_COLUMNS.index("flags")
_BITS = {kind: 1 << bit for bit, kind in enumerate(TILE_FLAGS)}
_NO_TILES: list[Sequence[Any]] = []
# Built once, and compiled once per dialect (:func:`_fetch`).
_HOSTS = select(Host.id, Host.hostname, Host.last_received_at).order_by(Host.hostname)
_TILES = select(
    Gpu.host_id,
    Gpu.gpu_index,
    Gpu.memory_total_bytes,
    case((Gpu.lost, None), else_=Gpu.memory_used_bytes),
    Gpu.holder_user,
    Gpu.holder_bytes,
    Gpu.holder_processes,
    Gpu.holder_users,
    Gpu.open_flags,
).order_by(Gpu.host_id, Gpu.gpu_index)


def _fetch(connection: Connection, statement: Select[*tuple[Any, ...]]) -> Sequence[Any]:
    """The rows of one of this module's statements, as the driver's cursor returns them.

    SQLAlchemy's result handling, light as it is, cost 10 to 20% of fetching 8,000 tile
    rows on SQLite. So the statement is compiled once per dialect, run as plain SQL on
    the session's connection (same transaction, same events), and its rows taken from
    the DBAPI cursor. Only for statements without parameters whose columns need no
    type processing: ints, floats, strings, NULL.
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
