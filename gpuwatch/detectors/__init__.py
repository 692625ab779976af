"""Pure detectors over samples and snapshots: idle, leak, filling up, share, orphan,
unattributed; and :func:`bucketize`, the server's downsampling of polls into samples.

Each takes data and thresholds and returns a :class:`Finding` or ``None``; none reads a
clock, a database or settings, so the server, the CLI and tests call them alike.
docs/detection.md states each verdict's rule, guarantees and measured quality.
"""

from gpuwatch.detectors.buckets import bucketize
from gpuwatch.detectors.filling import detect_filling
from gpuwatch.detectors.idle import detect_idle
from gpuwatch.detectors.leak import detect_leak
from gpuwatch.detectors.orphan import detect_orphan
from gpuwatch.detectors.share import detect_share
from gpuwatch.detectors.types import Finding, FindingKind, FindingReason, Sample
from gpuwatch.detectors.unattributed import detect_unattributed

__all__ = [
    "Finding",
    "FindingKind",
    "FindingReason",
    "Sample",
    "bucketize",
    "detect_filling",
    "detect_idle",
    "detect_leak",
    "detect_orphan",
    "detect_share",
    "detect_unattributed",
]
