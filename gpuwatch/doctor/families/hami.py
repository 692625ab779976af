"""HAMi (Kubernetes GPU sharing): the pod's share of a GPU, not the card, ran out.

HAMi-core intercepts CUDA in a pod and enforces the memory its ``nvidia.com/gpumem``
(or ``gpumem-percentage``) request grants:

* ``[HAMI-core ERROR (pid:25 thread=... allocator.c:53)]: Device 0 OOM 27147995136 /
  25757220864``: the allocation would take the pod to the first figure, over its limit,
  the second (bytes).
* ``[HAMI-core ERROR (...)]: cuMemoryAllocate failed res=2``: the allocation was refused
  with CUDA_ERROR_OUT_OF_MEMORY (2), by the limit or by the card.
"""

from __future__ import annotations

import re

from gpuwatch.doctor.facts import OomFacts
from gpuwatch.doctor.families.clauses import Found, spans

_LIMIT = re.compile(r"Device\s+(?P<index>\d+)\s+OOM\s+(?P<wanted>\d+)\s*/\s*(?P<limit>\d+)")
_ALLOCATE = re.compile(r"cuMemoryAllocate\s+failed\s+res\s*=\s*2\b")
_HAMI = re.compile(r"HAMI-core|HAMi", re.IGNORECASE)
CONTEXT_CHARS = 200


def find(window: str) -> list[Found]:
    """Every HAMi-core refusal in ``window``."""
    found = []
    for span in spans(window, _LIMIT, limit=400):
        if not _HAMI.search(window, max(0, span.start - CONTEXT_CHARS), span.start):
            continue  # "Device 0 OOM a / b" alone could be anyone's
        match = _LIMIT.match(window, span.start)
        assert match is not None
        facts = OomFacts(
            kind="hami",
            category="hami_pod_limit",
            device_type="cuda",
            device_index=int(match["index"]),
            would_use_bytes=int(match["wanted"]),
            allowed_bytes=int(match["limit"]),
            message=span.snippet,
        )
        found.append(Found(span.start, facts))
    for span in spans(window, _ALLOCATE, limit=400):
        facts = OomFacts(
            kind="hami",
            category="hami_allocate_failed",
            device_type="cuda",
            cuda_error="CUDA_ERROR_OUT_OF_MEMORY",
            cuda_error_code=2,
            api_call="cuMemoryAllocate",
            message=span.snippet,
        )
        found.append(Found(span.start, facts))
    return found
