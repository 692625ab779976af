"""``python -m bench [NAME ...]``: run the benchmarks (all by default) into bench/results/."""

from __future__ import annotations

import importlib
import sys

BENCHMARKS = (
    "agent",
    "server",
    "detection",
    "detection_share",
    "alerts",
    "reaper",
    "dashboard",
    "writer",
    "fillfactor",
    "duty_cycle",
    "load",
    "reliability",  # last: renders docs/reliability.md from the results above
)


def main(argv: list[str]) -> int:
    names = argv or list(BENCHMARKS)
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        print(f"unknown benchmark(s): {', '.join(unknown)}; choose from {', '.join(BENCHMARKS)}")
        return 2
    for name in names:
        print(f"== {name}", flush=True)
        importlib.import_module(f"bench.{name}").main()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
