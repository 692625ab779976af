"""A host's GPUs as the fleet page draws them: one compact JSON text per host, kept on
the host's row by ingest (``hosts.tiles``), so the page reads one row per host instead
of one per GPU and writes no markup per GPU (its script draws the tiles,
gpuwatch/server/web/static/dashboard.js).

At 1,000 hosts of 8 GPUs, turning 8,000 GPU rows into Python values and markup was
most of the page's time, each step about as long as the whole ``/api/v1/fleet``
summary (bench/dashboard.py). Building the text costs ingest about 30 µs a snapshot of
8 GPUs (measured on a busy 2-core VM: under 1% of what ingest spends on the snapshot),
on a host row it writes anyway.

The text is a JSON array with one array per GPU, by index, of:

* ``index``: the GPU's index;
* ``percent``: whole percent of its memory used (``used * 100 // total``, bytes), or
  null without a current reading (lost, or no figures): the tile's colour;
* ``used_mib``, ``total_mib``: memory used and total in MiB (null when unknown or
  lost);
* ``largest_mib``: the largest holder's memory in MiB (0 when nobody holds any);
* ``processes``, ``users``: how many processes and distinct users hold memory;
* ``user``: the largest holder's owner (null when unknown or nobody);
* ``flags``: the GPU's open events as a mask of
  :data:`~gpuwatch.server.hosts.models.GPU_FLAG_KINDS`.

Silence is not in it: it is the host's, worked out by the page from the host's last
report.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from operator import attrgetter
from typing import Protocol

MIB = 2**20
_ENCODE = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode
_INDEX = attrgetter("gpu_index")


class TileGpu(Protocol):
    """What a tile is made of: a GPU row as ingest holds it (ingest/state.py)."""

    gpu_index: int
    memory_total_bytes: int | None
    memory_used_bytes: int | None
    lost: bool
    holder_user: str | None
    holder_bytes: int | None
    holder_processes: int
    holder_users: int
    open_flags: int


def tiles_text(gpus: Iterable[TileGpu]) -> str:
    """The host's tiles (see the module docstring), its GPUs by index."""
    tiles = []
    for gpu in sorted(gpus, key=_INDEX):
        total, used = gpu.memory_total_bytes, None if gpu.lost else gpu.memory_used_bytes
        tiles.append(
            (
                gpu.gpu_index,
                used * 100 // total if used is not None and total else None,
                None if used is None else used // MIB,
                None if total is None else total // MIB,
                (gpu.holder_bytes or 0) // MIB,
                gpu.holder_processes,
                gpu.holder_users,
                gpu.holder_user,
                gpu.open_flags,
            )
        )
    return _ENCODE(tiles)
