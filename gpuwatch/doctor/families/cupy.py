"""CuPy's memory pool: ``Out of memory allocating 25,600,000 bytes (allocated so far:
3,635,267,072 bytes).`` and ``out of memory to allocate 1073741824 bytes (total
12373894656 bytes)``, where *total* is what the pool holds. Both are raised as
``cupy.cuda.memory.OutOfMemoryError``, which Chainer's trainer prints without its name.

The exception's name alone (an issue's title, a Jupyter traceback's header) is CuPy's
out-of-memory too, with no figures: ``cupy.cuda.memory.OutOfMemoryError in forward``.
"""

from __future__ import annotations

import re

from gpuwatch.doctor.facts import OomFacts
from gpuwatch.doctor.families.clauses import Found, exception_before, spans

_SO_FAR = re.compile(
    r"Out\s+of\s+memory\s+allocating\s+(?P<req>\d[\d,]*)\s+bytes\s+\(allocated\s+so\s+far:\s+"
    r"(?P<pool>\d[\d,]*)\s+bytes\)"
)
_TOTAL = re.compile(
    r"out\s+of\s+memory\s+to\s+allocate\s+(?P<req>\d[\d,]*)\s+bytes\s+\(total\s+(?P<pool>\d[\d,]*)\s+bytes\)"
)
_EXCEPTION = "cupy.cuda.memory.OutOfMemoryError"
# The dotted name, as CuPy defines it (cupy.cuda.memory) or as it is imported (cupy.cuda).
# Followed by its message, it is that message (read above, or a wording not CuPy's pool's:
# a PR quoting "OutOfMemoryError: out of memory to allocate XXXX bytes").
_NAME = re.compile(r"(?<![\w.])cupy\.cuda\.(?:memory\.)?OutOfMemoryError\b(?![ \t]*:)")


def find(window: str) -> list[Found]:
    """Every CuPy memory-pool OOM in ``window``."""
    found = []
    for header in (_SO_FAR, _TOTAL):
        for span in spans(window, header, limit=300):
            match = header.match(window, span.start)
            assert match is not None
            named = exception_before(window, span.start)
            facts = OomFacts(
                kind="cupy",
                category="cupy_oom",
                exception=named if named and "OutOfMemory" in named else _EXCEPTION,
                device_type="cuda",
                requested_bytes=int(match["req"].replace(",", "")),
                message=span.snippet,
            )
            pool = int(match["pool"].replace(",", ""))
            if header is _SO_FAR:
                facts.allocated_bytes = pool
            else:
                facts.reserved_bytes = pool
            found.append(Found(span.start, facts))
    if found:
        return found
    for span in spans(window, _NAME, limit=300, needs=("cupy",))[:1]:
        match = _NAME.match(window, span.start)
        assert match is not None
        facts = OomFacts(
            kind="cupy",
            category="cupy_oom_name_only",
            exception=match[0],
            device_type="cuda",
            message=span.snippet,
        )
        found.append(Found(span.start, facts))
    return found
