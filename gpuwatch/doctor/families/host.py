"""A worker killed with SIGKILL: usually the kernel's OOM killer, for host RAM.

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
from gpuwatch.doctor.families.clauses import Found, spans

_SIGKILL = re.compile(
    r"failed\s+\(exitcode:\s*-9\)|exitcode\s*:\s*-9\b|Signal\s+9\s+\(SIGKILL\)\s+received"
)
_PID = re.compile(r"\(pid:\s*(?P<pid>\d+)\)|received\s+by\s+PID\s+(?P<pid2>\d+)")


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
