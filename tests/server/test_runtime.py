"""The server process's interpreter tuning (run in a child: it is process-wide)."""

from __future__ import annotations

import subprocess
import sys

from gpuwatch.server.runtime import GC_THRESHOLDS


def test_tune_gc_freezes_what_exists_and_raises_the_thresholds() -> None:
    probe = (
        "import gc\n"
        "from gpuwatch.server.runtime import tune_gc\n"
        "before = (gc.get_threshold(), gc.get_freeze_count())\n"
        "tune_gc()\n"
        "print(before, (gc.get_threshold(), gc.get_freeze_count() > 1000), gc.isenabled())\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert out == f"((700, 10, 10), 0) ({GC_THRESHOLDS}, True) True"
