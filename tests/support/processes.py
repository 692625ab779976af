"""Stopping the real processes a test started."""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Iterable
from typing import Any


def stop_processes(processes: Iterable[subprocess.Popen[Any]]) -> None:
    """SIGTERM every process still running, then wait for each (SIGKILL past 20 s)."""
    processes = list(processes)
    for proc in processes:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in processes:
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
