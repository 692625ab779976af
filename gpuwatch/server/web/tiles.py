"""The fleet page's reads: every GPU of the fleet as one row, with its largest holder,
how many processes and users hold memory on it, and its open flags.

Three queries whatever the fleet size: the hosts (by name), the tiles (one row per GPU,
by host and index, with the holders ingest keeps on the GPU's row), and the open events
(one row each: they become the tiles' flag masks, the held memory, and the hosts with
an event about the host itself). The tile rows are split by host with
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

from gpuwatch.server.events.models import Event
from gpuwatch.server.hosts.models import Gpu, Host
from gpuwatch.server.hosts.service import silence_threshold_seconds
from gpuwatch.settings import ServerSettings

# Event kinds a tile flags (an open event of the kind on that GPU), in the order of the
# bits of a tile's flag mask: bit ``i`` set means an open ``TILE_FLAGS[i]`` event.
TILE_FLAGS = ("orphaned", "idle", "filling_up", "runaway", "gpu_lost")

# A tile row, as the tiles query returns it: the GPU's host (id), index, total and used
# bytes (used None: no current reading, or the GPU is lost); the owner of its largest
# process and that process's bytes (None when nobody holds memory there), how many
# processes and distinct users hold memory on it.
TILE_COLUMNS = ("host_id", "gpu_index", "total_bytes", "used_bytes", "user", "largest_bytes",
                "processes", "users")  # fmt: skip


class FleetHost(NamedTuple):
    """A host of the fleet page and its GPUs, each a row of :data:`TILE_COLUMNS`."""

    hostname: str
    silent: bool
    tiles: Sequence[Sequence[Any]]
    # GPU index -> its open events as a bit mask of TILE_FLAGS (bit ``i``: an open
    # ``TILE_FLAGS[i]`` event); a GPU without any is absent.
    masks: dict[int, int]
    # Silent, or an open event about the host itself (agent_silent) or on one of its GPUs.
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
    # The open events: host id, GPU index (None: about the host), kind, held bytes.
    events: Sequence[Sequence[Any]]


def fleet_tiles(*, session: Session, settings: ServerSettings, now: float) -> Fleet:
    """Every GPU with its holders and open flags, and the header's totals."""
    return group_fleet(read_fleet(session=session), settings, now)


def read_fleet(*, session: Session) -> FleetRows:
    """What the fleet page shows: its hosts, one row per GPU, the open events.

    Each GPU's holders are read from its own row, where ingest keeps them
    (``gpus.holder_*``, ingest/state.py): aggregating the 50,000 open lifetimes of a
    1,000-host fleet on every request was most of the page's time (bench/dashboard.py).
    Rows come as plain tuples from the driver (:func:`_fetch`), and open events are
    found through their ``(host_id, ended_at)`` index, so the closed ones that
    retention keeps around are never read.
    """
    connection = session.connection()
    hosts = _fetch(connection, _HOSTS)
    tiles = _fetch(connection, _TILES)
    # The open events, one row each: the tiles' flags, the held memory and the hosts with
    # an event about the host itself are worked out from them in group_fleet. Joined to
    # the tiles in SQL (a mask per GPU: grouped, materialised, indexed, looked up per
    # GPU) they cost twice as much as read as rows and put in a dict per host; grouped
    # into masks in SQL alone, 6.8 against 3.8 ms for 6,000 events on SQLite.
    events = _fetch(connection, _EVENTS)
    return FleetRows(hosts, tiles, events)


def group_fleet(rows: FleetRows, settings: ServerSettings, now: float) -> Fleet:
    """The tile rows of :func:`read_fleet` split by host (each host's rows stay as they
    came), the open events made into each host's flag masks, and the page's totals.
    Per tile only the GPUs of hosts with flags are looked at (to count GPUs per flag
    as the page shows them); the rest is per host or per event."""
    held_bytes = {"orphaned": 0, "idle": 0}
    about_host: set[int] = set()
    masks: dict[int, dict[int, int]] = {}
    for host_id, index, kind, event_bytes in rows.events:
        if kind in held_bytes:
            held_bytes[kind] += event_bytes or 0
        if index is None:
            about_host.add(host_id)
        elif kind in _BITS:
            host_masks = masks.setdefault(host_id, {})
            host_masks[index] = host_masks.get(index, 0) | _BITS[kind]
    by_host = {host_id: list(tiles) for host_id, tiles in groupby(rows.tiles, _HOST_ID)}
    reporting_since = now - silence_threshold_seconds(settings)
    hosts = []
    shown: Counter[int] = Counter()  # flag masks of the GPUs on the page
    for host_id, hostname, received in rows.hosts:
        tiles = by_host.get(host_id, _NO_TILES)
        silent = received is None or received < reporting_since
        host_masks = masks.get(host_id, _NONE)
        flagged = silent or host_id in about_host
        if host_masks:
            on_tiles = [host_masks[tile[1]] for tile in tiles if tile[1] in host_masks]
            shown.update(on_tiles)
            flagged = flagged or bool(on_tiles)
        hosts.append(FleetHost(hostname, silent, tiles, host_masks, flagged))
    flagged_gpus = {
        kind: sum(n for mask, n in shown.items() if mask & bit) for kind, bit in _BITS.items()
    }
    return Fleet(
        hosts=hosts,
        gpus=len(rows.tiles),
        held_bytes=held_bytes,
        flagged=flagged_gpus,
        silent_hosts=sum(1 for host in hosts if host.silent),
    )


_HOST_ID = itemgetter(0)
_BITS = {kind: 1 << bit for bit, kind in enumerate(TILE_FLAGS)}
_NONE: dict[int, int] = {}
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
).order_by(Gpu.host_id, Gpu.gpu_index)
_EVENTS = select(Event.host_id, Event.gpu_index, Event.kind, Event.held_bytes).where(
    Event.host_id.in_(select(Host.id)), Event.ended_at.is_(None)
)


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
