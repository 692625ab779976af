"""Times gpustat's query; run under ``gpuwatch fake-nvml exec`` by bench/agent.py.

A separate process because gpustat patches pynvml's wrappers when imported, which
would change what the in-process gpuwatch measurement runs.
"""

from __future__ import annotations

import json
import sys

import gpustat

from bench.common import best_of

if __name__ == "__main__":
    repeat, number = int(sys.argv[1]), int(sys.argv[2])
    query = gpustat.new_query()
    processes = sum(len(gpu.processes or []) for gpu in query.gpus)
    seconds = best_of(gpustat.new_query, repeat=repeat, number=number)
    print(json.dumps({"seconds": seconds, "gpus": len(query.gpus), "processes": processes}))
