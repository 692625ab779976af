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


def test_the_open_files_limit_is_raised_within_the_hard_limit_and_never_lowered() -> None:
    probe = (
        "import resource\n"
        "from gpuwatch.server.runtime import OPEN_FILES_WANTED, raise_open_files_limit\n"
        "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
        "cap = min(hard, 4096)\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (256, cap))  # a low soft, a low hard\n"
        "raise_open_files_limit()\n"
        "raised = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (cap, cap))\n"
        "raise_open_files_limit()\n"
        "print(raised == (cap, cap), resource.getrlimit(resource.RLIMIT_NOFILE) == (cap, cap))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert out == "True True"
