"""PaddlePaddle: its allocator's ``BadAlloc`` report.

Wordings (Paddle's ``memory/allocation``; the device word is the place's, ``GPU`` for
CUDA and ROCm builds, ``XPU``/``NPU`` for others):

* 2.x: ``Out of memory error on GPU 0. Cannot allocate 56.000000MB memory on GPU 0,
  7.782776GB memory has been allocated and available memory is only 12.750000MB.``
  (``has been allocated`` is this process's own; older 2.0 builds leave that clause out).
* 1.x: ``Out of memory error on GPU 0. Cannot allocate 145.468994MB GPU memory,
  available memory is 72.312500MB.``, sometimes with ``FLAGS_fraction_of_gpu_memory_to_use
  is 0.92 now``.
* Before 1.5: ``enforce allocating <= available failed, 10513462067 > 1369702144``.

Sizes are Paddle's ``%f`` of binary units (``MB`` is MiB).
"""

from __future__ import annotations

import re

from gpuwatch.doctor.facts import OomFacts
from gpuwatch.doctor.families.clauses import Found, Span, compile_clause, spans

_HEADER = re.compile(r"Out\s+of\s+memory\s+error\s+on\s+(?P<dev>[A-Z]{2,5})\s+(?P<index>\d+)\.")
_REQUESTED = compile_clause(r"Cannot\s+allocate\s+", r"\s+(?:[A-Z]{2,5}\s+)?memory")
_ALLOCATED = compile_clause(r",\s*", r"\s+memory\s+has\s+been\s+allocated")
_AVAILABLE = compile_clause(r"available\s+memory\s+is\s+(?:only\s+)?")
_FRACTION = re.compile(r"FLAGS_fraction_of_gpu_memory_to_use\s+is\s+(?P<fraction>[\d.]+)")
_ENFORCE = re.compile(
    r"enforce\s+allocating\s+<=\s+available\s+failed,\s+(?P<wanted>\d+)\s+>\s+(?P<available>\d+)"
)
_BAD_ALLOC = re.compile(r"(paddle::memory::allocation::BadAlloc|ResourceExhaustedError)")
# The exception's C++ name alone, as "terminate called after throwing an instance of
# 'paddle::memory::allocation::BadAlloc'" prints it when nothing caught it (its what() may
# be empty, and the C++ traceback after it names the allocator's frames, not sizes).
_BAD_ALLOC_NAME = re.compile(r"(?<![\w:])(?:paddle::)?memory::allocation::BadAlloc\b")
EXCEPTION_LOOKBACK_CHARS = 400


def find(window: str) -> list[Found]:
    """Every Paddle out-of-memory report in ``window``."""
    found = [Found(span.start, _facts(span)) for span in spans(window, _HEADER, limit=1200)]
    for match in _ENFORCE.finditer(window):
        facts = OomFacts(
            kind="paddle",
            category="paddle_enforce_allocating",
            device_type="gpu",
            requested_bytes=int(match["wanted"]),
            free_bytes=int(match["available"]),
            message=window[match.start() : match.end()],
        )
        found.append(Found(match.start(), facts))
    if found:
        return found
    # The name alone, like CuPy's (cupy.py): Paddle's out-of-memory, with no figures.
    for span in spans(window, _BAD_ALLOC_NAME, limit=300, needs=("badalloc",))[:1]:
        facts = OomFacts(
            kind="paddle",
            category="paddle_bad_alloc",
            exception="paddle::memory::allocation::BadAlloc",
            message=span.snippet,
        )
        found.append(Found(span.start, facts))
    return found


def _facts(span: Span) -> OomFacts:
    header = _HEADER.match(span.text, span.start)
    assert header is not None
    before = span.text[max(0, span.start - EXCEPTION_LOOKBACK_CHARS) : span.start]
    exceptions = _BAD_ALLOC.findall(before)
    fraction = span.group(_FRACTION, "fraction")
    return OomFacts(
        kind="paddle",
        category="paddle_out_of_memory",
        exception=exceptions[-1] if exceptions else None,
        device_type="gpu" if header["dev"] == "GPU" else header["dev"].lower(),
        device_index=int(header["index"]),
        requested_bytes=span.size(_REQUESTED),
        allocated_bytes=span.size(_ALLOCATED),
        free_bytes=span.size(_AVAILABLE),
        advice=f"FLAGS_fraction_of_gpu_memory_to_use={fraction}" if fraction else None,
        message=span.snippet,
    )
