"""The fleet page's reads: every GPU of the fleet as one row, with its largest holder,
how many processes and users hold memory on it, and its open flags.

Three queries whatever the fleet size: the tiles (hosts, GPUs and holders joined in
SQL, one row per GPU), the open events (one row each: they become the tiles' flag
masks, the held memory, and the hosts with an event about the host itself), and GPUs
per fullness bucket (the very query behind ``/api/v1/fleet``, so the page's header and
the API always agree). The tile rows are split by host with ``itertools.groupby`` and
handed to the template as they came: the one Python loop that does real work per
tile is the one that writes it.

Sizes are bytes, times Unix epoch seconds (the agents' clocks, as stored), as in the
rest of the server.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from itertools import groupby
from operator import itemgetter
from typing import Any, NamedTuple

from sqlalchemy import Subquery, func, select
from sqlalchemy.dialects.postgresql import aggregate_order_by, array_agg
from sqlalchemy.orm import Session

from gpuwatch.server.events.models import Event
from gpuwatch.server.fleet.service import gpus_by_fullness
from gpuwatch.server.hosts.models import Gpu, Host
from gpuwatch.server.hosts.service import silence_threshold_seconds
from gpuwatch.server.processes.models import ProcessLifetime
from gpuwatch.settings import ServerSettings

# Event kinds a tile flags (an open event of the kind on that GPU), in the order of the
# bits of a tile's flag mask: bit ``i`` set means an open ``TILE_FLAGS[i]`` event.
TILE_FLAGS = ("orphaned", "idle", "filling_up", "runaway", "gpu_lost")

# A tile row, as the tiles query returns it: the host's name and last report, the GPU's
# index, total and used bytes (None: unknown), whether it is lost; the owner of its
# largest process and that process's bytes, how many processes and distinct users hold
# memory on it (all four None when nobody does). A host without GPUs has one row with a
# NULL index.
TILE_COLUMNS = ("hostname", "received_at", "gpu_index", "total_bytes", "used_bytes", "lost",
                "user", "largest_bytes", "processes", "users")  # fmt: skip


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
    fullness: dict[str, int]  # GPUs per bucket, as in /api/v1/fleet
    held_bytes: dict[str, int]  # open orphaned / idle events' held memory
    flagged: dict[str, int]  # GPUs per flag
    silent_hosts: int


class FleetRows(NamedTuple):
    """The fleet page's reads, as rows and counts (see :func:`read_fleet`)."""

    tiles: Sequence[Sequence[Any]]  # TILE_COLUMNS, one per GPU, by hostname and index
    # The open events: hostname, GPU index (None: about the host), kind, held bytes.
    events: Sequence[Sequence[Any]]
    fullness: dict[str, int]


def fleet_tiles(*, session: Session, settings: ServerSettings, now: float) -> Fleet:
    """Every GPU with its holders and open flags, and the header's totals."""
    return group_fleet(read_fleet(session=session, settings=settings, now=now), settings, now)


def read_fleet(*, session: Session, settings: ServerSettings, now: float) -> FleetRows:
    """What the fleet page shows, reduced in SQL to one row per GPU and a few counts.

    Measured at 1,000 hosts x 8 GPUs x 50 processes (bench/dashboard.py), reading the
    50,000 open lifetimes for each GPU's holders is most of the page's time, so it is
    one aggregate where they are read (see :func:`holders_by_gpu`). Rows come through
    Core (the ORM's row handling cost a third more), and open lifetimes and events are
    found through their ``(host_id, ended_at)`` index, so the closed ones that
    retention keeps around are never read.
    """
    connection = session.connection()
    holders = holders_by_gpu(session.get_bind().dialect.name)
    tiles = connection.execute(
        select(
            Host.hostname,
            Host.last_received_at,
            Gpu.gpu_index,
            Gpu.memory_total_bytes,
            Gpu.memory_used_bytes,
            Gpu.lost,
            holders.c.user,
            holders.c.largest_bytes,
            holders.c.processes,
            holders.c.users,
        )
        .select_from(Host)
        .outerjoin(Gpu, Gpu.host_id == Host.id)
        .outerjoin(holders, holders.c.gpu_id == Gpu.id)
        .order_by(Host.hostname, Gpu.gpu_index)
    ).all()
    # The open events, one row each: the tiles' flags, the held memory and the hosts with
    # an event about the host itself are worked out from them in group_fleet. Joined to
    # the tiles in SQL (a mask per GPU: grouped, materialised, indexed, looked up per
    # GPU) they cost twice as much as read as rows and put in a dict per host.
    events = connection.execute(
        select(Host.hostname, Event.gpu_index, Event.kind, Event.held_bytes)
        .select_from(Event)
        .join(Host, Host.id == Event.host_id)
        .where(Event.host_id.in_(select(Host.id)), Event.ended_at.is_(None))
    ).all()
    fullness = gpus_by_fullness(session=session, settings=settings, now=now)
    return FleetRows(tiles, events, fullness)


def group_fleet(rows: FleetRows, settings: ServerSettings, now: float) -> Fleet:
    """The tile rows of :func:`read_fleet` split by host (each host's rows stay as they
    came), the open events made into each host's flag masks, and the page's totals.
    Per tile only the GPUs of hosts with flags are looked at (to count GPUs per flag
    as the page shows them); the rest is per host or per event."""
    held_bytes = {"orphaned": 0, "idle": 0}
    about_host: set[str] = set()
    masks: dict[str, dict[int, int]] = {}
    for hostname, index, kind, event_bytes in rows.events:
        if kind in held_bytes:
            held_bytes[kind] += event_bytes or 0
        if index is None:
            about_host.add(hostname)
        elif kind in _BITS:
            host_masks = masks.setdefault(hostname, {})
            host_masks[index] = host_masks.get(index, 0) | _BITS[kind]
    reporting_since = now - silence_threshold_seconds(settings)
    hosts = []
    shown: Counter[int] = Counter()  # flag masks of the GPUs on the page
    for hostname, grouped in groupby(rows.tiles, _HOSTNAME):
        tiles = list(grouped)
        received = tiles[0][1]
        silent = received is None or received < reporting_since
        if tiles[0][2] is None:  # a host whose agent never reported a GPU
            tiles = []
        host_masks = masks.get(hostname, _NONE)
        on_tiles = [host_masks[tile[2]] for tile in tiles if tile[2] in host_masks]
        shown.update(on_tiles)
        flagged = silent or hostname in about_host or bool(on_tiles)
        hosts.append(FleetHost(hostname, silent, tiles, host_masks, flagged))
    flagged_gpus = {
        kind: sum(n for mask, n in shown.items() if mask & bit) for kind, bit in _BITS.items()
    }
    return Fleet(
        hosts=hosts,
        gpus=sum(rows.fullness.values()),
        fullness=rows.fullness,
        held_bytes=held_bytes,
        flagged=flagged_gpus,
        silent_hosts=sum(1 for host in hosts if host.silent),
    )


_HOSTNAME = itemgetter(0)
_BITS = {kind: 1 << bit for bit, kind in enumerate(TILE_FLAGS)}
_NONE: dict[int, int] = {}


def holders_by_gpu(dialect: str) -> Subquery:
    """Per GPU with open lifetimes: the owner of the largest and its bytes, and how many
    processes and distinct users hold memory there; one row per GPU, in one pass.

    SQLite takes a bare column of a ``max()`` aggregate from the row holding the
    maximum (a window function there cost five times as much); between processes of
    equal size it names one of them. Postgres has no bare columns: the owners ordered
    by size (then lifetime id, so a tie names the oldest), first one taken, in the same
    ``GROUP BY`` (a ``ROW_NUMBER()`` window joined to the counts sorted the lifetimes
    twice and cost a fifth more).
    """
    life = ProcessLifetime
    if dialect == "sqlite":
        owner = life.user
    else:
        owner = array_agg(
            aggregate_order_by(life.user, life.current_bytes.desc().nulls_last(), life.id)
        )[1]
    return (
        select(
            life.gpu_id,
            owner.label("user"),
            func.max(life.current_bytes).label("largest_bytes"),
            func.count().label("processes"),
            func.count(life.user.distinct()).label("users"),
        )
        .where(life.host_id.in_(select(Host.id)), life.ended_at.is_(None))
        .group_by(life.gpu_id)
        .subquery()
    )
