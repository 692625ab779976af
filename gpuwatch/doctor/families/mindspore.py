"""MindSpore: its device memory pool (Ascend NPU or GPU) could not serve an allocation.

MindSpore takes a pool of device memory when it starts (``max_device_memory``, most of
the card by default) and serves every tensor from it. Wordings (``mindspore/ccsrc``):

* ``mem_dynamic_allocator.cc``: ``TotalUsedMemStatistics : U plus TotalUsedByEventMemStatistics
  : E and plus alloc size : A is more than total mem size : T.`` (bytes: in use, the
  request, the pool).
* ``Malloc for kernel output failed, Memory isn't enough, node:Default/Cast-op446``, and
  ``Device(id:0) memory isn't enough and alloc failed, kernel name: ..., alloc size: N B``.
"""

from __future__ import annotations

import re

from gpuwatch.doctor.facts import OomFacts
from gpuwatch.doctor.families.clauses import Found, exception_before, spans

_POOL = re.compile(
    r"TotalUsedMemStatistics\s*:\s*(?P<used>\d+).{0,120}?alloc\s+size\s*:\s*(?P<requested>\d+)"
    r"\s+is\s+more\s+than\s+total\s+mem\s+size\s*:\s*(?P<total>\d+)"
)
_NOT_ENOUGH = re.compile(r"(?:Device\(id:\s*(?P<device>\d+)\)\s+)?[Mm]emory\s+isn't\s+enough")
_ALLOC_SIZE = re.compile(r"alloc\s+size:\s*(\d+)\s*B\b")
_NODE = re.compile(r"node:\s*(\S+)|kernel\s+name:\s*([^,\s]+)")


def find(window: str) -> list[Found]:
    """The first MindSpore pool refusal in ``window`` (it logs one line per retry)."""
    for span in spans(window, _POOL, limit=400)[:1]:
        match = _POOL.match(window, span.start)
        assert match is not None
        used, requested = int(match["used"]), int(match["requested"])
        facts = OomFacts(
            kind="mindspore",
            category="mindspore_pool_exhausted",
            requested_bytes=requested,
            allocated_bytes=used,
            allowed_bytes=int(match["total"]),
            message=span.snippet,
        )
        return [Found(span.start, facts)]
    for span in spans(window, _NOT_ENOUGH, limit=400)[:1]:
        match = _NOT_ENOUGH.match(window, span.start)
        assert match is not None
        node = _NODE.search(window, span.start, span.end)
        facts = OomFacts(
            kind="mindspore",
            category="mindspore_pool_exhausted",
            exception=exception_before(window, span.start),
            device_index=int(match["device"]) if match["device"] else None,
            requested_bytes=span.integer(_ALLOC_SIZE),
            api_call=(node[1] or node[2]) if node else None,
            message=span.snippet,
        )
        return [Found(span.start, facts)]
    return []
