"""Pure detectors over samples and snapshots: idle, leak, share, orphan, unattributed.

Each takes data and thresholds and returns a :class:`Finding` or ``None``; none reads a
clock, a database or settings, so the server, the CLI and tests call them alike.
"""

from gpuwatch.server.detectors.idle import detect_idle
from gpuwatch.server.detectors.leak import detect_leak
from gpuwatch.server.detectors.orphan import detect_orphan
from gpuwatch.server.detectors.share import detect_share
from gpuwatch.server.detectors.types import Finding, FindingKind, FindingReason, Sample
from gpuwatch.server.detectors.unattributed import detect_unattributed

__all__ = [
    "Finding",
    "FindingKind",
    "FindingReason",
    "Sample",
    "detect_idle",
    "detect_leak",
    "detect_orphan",
    "detect_share",
    "detect_unattributed",
]
