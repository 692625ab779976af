"""Host RAM, not the GPU: PyTorch's CPU allocator refusing, or a worker killed with SIGKILL.

PyTorch's CPU allocator says so itself: ``DefaultCPUAllocator: can't allocate memory:
you tried to allocate N bytes. Error code 12 (Cannot allocate memory)`` (Linux), ``...
not enough memory: you tried to allocate N bytes.`` (Windows), and the legacy TH's ``$
Torch: not enough memory: you tried to allocate 3GB. Buy new RAM!``. The tensor was on
the CPU (a model loaded there first, a batch collated there), so the fix is system RAM.

``torchrun`` (torch.distributed.elastic) reports a worker that died of signal 9 as
``failed (exitcode: -9) local_rank: 0 (pid: 1322)`` and, in its summary, ``exitcode : -9``
with ``Signal 9 (SIGKILL) received by PID 14750``. People read it as a GPU
out-of-memory; on Linux it is nearly always the kernel's OOM killer reclaiming system
RAM (data-loader workers, a model loaded on the CPU first), though a scheduler's kill
(Slurm's time or memory limit) looks the same. A GPU OOM raises an exception instead.
"""

from __future__ import annotations

import re

from gpuwatch.doctor.facts import OomFacts
from gpuwatch.doctor.families.clauses import Found, compile_clause, exception_before, spans

_SIGKILL = re.compile(
    r"failed\s+\(exitcode:\s*-9\)|exitcode\s*:\s*-9\b|Signal\s+9\s+\(SIGKILL\)\s+received"
)
_CPU_ALLOCATOR = re.compile(
    r"DefaultCPUAllocator:\s*(?:can't\s+allocate|not\s+enough)\s+memory:\s*you\s+tried\s+to\s+allocate\s+(?P<bytes>\d+)\s+bytes"
    r"|(?P<th>Torch:\s+not\s+enough\s+memory:)"
)
_TH_SIZE = compile_clause(r"you\s+tried\s+to\s+allocate\s+")
_PID = re.compile(r"\(pid:\s*(?P<pid>\d+)\)|received\s+by\s+PID\s+(?P<pid2>\d+)")


def find_cpu_allocator(window: str) -> list[Found]:
    """Every refusal of PyTorch's CPU allocator in ``window``."""
    found = []
    for span in spans(window, _CPU_ALLOCATOR, limit=300):
        match = _CPU_ALLOCATOR.match(window, span.start)
        assert match is not None
        facts = OomFacts(
            kind="host",
            category="cpu_allocator_out_of_memory",
            exception=exception_before(window, span.start),
            device_type="host",
            requested_bytes=span.size(_TH_SIZE) if match["th"] else int(match["bytes"]),
            message=span.snippet,
        )
        found.append(Found(span.start, facts))
    return found


def find(window: str) -> list[Found]:
    """The first SIGKILLed worker in ``window`` (the summary repeats it)."""
    for span in spans(window, _SIGKILL, limit=400)[:1]:
        pid = _PID.search(window, span.start, span.end)
        facts = OomFacts(
            kind="host",
            category="worker_sigkilled_host_oom_suspect",
            device_type="host",
            pid=int(pid["pid"] or pid["pid2"]) if pid else None,
            message=span.snippet,
        )
        return [Found(span.start, facts)]
    return []
