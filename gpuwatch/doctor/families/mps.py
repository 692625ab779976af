"""PyTorch on Apple silicon: ``MPS backend out of memory (MPS allocated: A, other
allocations: O, max allowed: M). Tried to allocate X on private pool.``

Builds up to 2024-25 print ``GB``/``MB``, later ones ``GiB``/``MiB``, sometimes mixed in
one message; both mean binary multiples. ``max allowed`` is the high-watermark limit
(``PYTORCH_MPS_HIGH_WATERMARK_RATIO`` of the recommended working set), not the RAM size.
"""

from __future__ import annotations

import re

from gpuwatch.doctor.facts import OomFacts
from gpuwatch.doctor.families.clauses import Found, compile_clause, exception_before, spans

_HEADER = re.compile(r"MPS\s+backend\s+out\s+of\s+memory")
_ALLOCATED = compile_clause(r"MPS\s+allocated:\s*")
_OTHER = compile_clause(r"other\s+allocations:\s*")
_MAX_ALLOWED = compile_clause(r"max\s+allowed:\s*")
_REQUESTED = compile_clause(r"Tried\s+to\s+allocate\s+")
_WATERMARK = re.compile(r"PYTORCH_MPS_HIGH_WATERMARK_RATIO")


def find(window: str) -> list[Found]:
    """Every MPS OOM message in ``window``."""
    found = []
    for span in spans(window, _HEADER, limit=800):
        facts = OomFacts(
            kind="mps",
            category="pytorch_mps_oom",
            exception=exception_before(window, span.start),
            device_type="mps",
            allocated_bytes=span.size(_ALLOCATED),
            other_allocations_bytes=span.size(_OTHER),
            allowed_bytes=span.size(_MAX_ALLOWED),
            requested_bytes=span.size(_REQUESTED),
            advice="PYTORCH_MPS_HIGH_WATERMARK_RATIO" if span.has(_WATERMARK) else None,
            message=span.snippet,
        )
        found.append(Found(span.start, facts))
    return found
