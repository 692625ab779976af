"""PID reuse: the killer never signals a process that took over a victim's PID.

The test makes the reuse happen for real, in a PID namespace of its own
(``unshare --pid --fork --mount-proc``, root only), by setting the namespace's
``ns_last_pid``: ``pid_reuse_inside.py`` runs there as PID 1 and reports back.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from reaper.rig import REPO_ROOT

HERE = Path(__file__).resolve().parent


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root and unshare"
)
def test_a_reused_pid_gets_zero_signals(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            "unshare",
            "--pid",
            "--fork",
            "--mount-proc",
            sys.executable,
            str(HERE / "pid_reuse_inside.py"),
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["namespace_pid"] == 1
    # Reused before the killer looked: refused on identity, nothing sent.
    assert result["before"] == {
        "outcome": "identity_changed",
        "same_pid": True,
        "impostor_alive": True,
    }
    # Reused after the pidfd was opened: the signal went to the (gone) victim's pidfd.
    assert result["after_pidfd"] == {
        "outcome": "already_exited",
        "same_pid": True,
        "impostor_alive": True,
    }
    assert result["delivered"] == []
    assert result["impostor_signals"] == ["", ""]
