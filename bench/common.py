"""What every benchmark shares: the machine line, timing, and writing results.

Absolute times on shared 2-core machines are noise; every figure here is reported
next to a baseline measured in the same run (the limit, or a peer tool), and the
ratio is what we quote.
"""

from __future__ import annotations

import json
import os
import platform
import signal
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


def machine_line() -> str:
    cpu = "unknown cpu"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return (
        f"{platform.node()}: {os.cpu_count()} cores ({cpu}), {mem_gib:.0f} GiB, "
        f"Python {platform.python_version()}, {platform.system()} {platform.release()}"
    )


def best_of(fn: Callable[[], Any], *, repeat: int = 5, number: int = 10) -> float:
    """Median seconds per call over ``repeat`` rounds of ``number`` calls.

    The median of rounds, not the minimum: the baseline and the subject get the same
    treatment, and a ratio of medians is robust to one noisy round on a shared machine.
    """
    fn()  # warm caches and lazy imports outside the measurement
    rounds = []
    for _ in range(repeat):
        started = time.perf_counter()
        for _ in range(number):
            fn()
        rounds.append((time.perf_counter() - started) / number)
    return statistics.median(rounds)


def interleaved(
    fns: dict[str, Callable[[], Any]], *, repeat: int = 7, number: int = 10
) -> dict[str, float]:
    """Like :func:`best_of` for several subjects, alternating them round by round so a
    burst of load from elsewhere hits all of them alike."""
    for fn in fns.values():
        fn()
    rounds: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            started = time.perf_counter()
            for _ in range(number):
                fn()
            rounds[name].append((time.perf_counter() - started) / number)
    return {name: statistics.median(values) for name, values in rounds.items()}


def write_result(name: str, result: dict[str, Any]) -> Path:
    """Write ``bench/results/<name>.json`` and a human summary next to it."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    result = {
        "benchmark": name,
        "machine": machine_line(),
        "date": time.strftime("%Y-%m-%d"),
        **result,
    }
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(result, indent=2, sort_keys=False) + "\n")
    return path


def terminate(proc: subprocess.Popen[Any], *, grace_seconds: float) -> None:
    """SIGTERM, then SIGKILL if ``proc`` has not exited within ``grace_seconds``; reaped."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=grace_seconds)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
