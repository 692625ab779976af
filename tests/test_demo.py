"""`gpuwatch demo`, the README's first command, end to end on simulated GPUs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def test_demo_shows_holders_and_what_the_server_concluded(tmp_path: Path) -> None:
    env = {**os.environ, "XDG_RUNTIME_DIR": str(tmp_path), "GPUWATCH_CONFIG": "/nonexistent"}
    result = subprocess.run(
        [sys.executable, "-m", "gpuwatch", "demo", "--duration", "6",
         "--listen", "127.0.0.1:0", "--server-listen", "127.0.0.1:0"],
        env=env, capture_output=True, text=True, timeout=180, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "ipykernel_launcher" in result.stdout and "DEAD PID" in result.stdout
    assert "orphaned/reparented" in result.stderr
    assert "orphaned/dead_pid" in result.stderr
    # The demo's stand-ins are gone when it returns.
    assert not list((tmp_path / "gpuwatch-fake").glob("*.json"))
