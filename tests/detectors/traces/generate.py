"""Write the detectors' trace corpus: raw polls as the server receives them, with the
verdicts each trace must (and must not) produce.

Run from the repository root after changing a trace or the format (deterministic: one
seed per trace, so the files only change when this script does)::

    .venv/bin/python tests/detectors/traces/generate.py

Format of ``<name>.json`` (one poll per index of ``t_ms``):

* ``t0`` (epoch s) and ``t_ms``: poll times as milliseconds after ``t0``. Polls follow
  a schedule of ``poll_seconds`` (+ ``drift_seconds`` when the agent's clock runs
  slow, the 15.002 s case), each poll within ``jitter_ratio`` of the interval from its
  scheduled time; ``gaps`` are spans with no polls at all (the agent was down).
* ``gpu_total_bytes``; ``unattributed_mib``: memory no process accounts for (or null).
* ``processes``: one entry per lifetime (``pid`` and ``start_time``, so a reused PID
  is a second entry), with ``used_mib`` (null where the process is not listed),
  ``sm_percent`` (integer percent as NVML gives it; null: unknown) and
  ``dead_after_ms`` (from then on the PID is dead but NVML still lists it).
* ``expect``: per verdict (``leak``, ``idle``, ``orphan`` keyed ``"pid@start_time"``;
  ``filling`` for the GPU), ``must`` and ``may`` lists of ``[from_s, until_s]`` after
  ``t0``. A verdict is required at every evaluation inside ``must``, allowed inside
  ``may``, and forbidden everywhere else; a key that is absent means "never".

The traces themselves are defined in ``catalog.py``.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from catalog import T0, Trace, catalog

HERE = Path(__file__).resolve().parent
MIB = 2**20


def poll_times(trace: Trace, rng: random.Random) -> list[float]:
    """Scheduled polls with non-accumulating jitter of ±3% of the interval, minus gaps."""
    step = trace.poll + trace.drift
    times = []
    for n in range(int(trace.duration / step) + 1):
        t = n * step + rng.uniform(-0.03, 0.03) * trace.poll
        if 0 <= t <= trace.duration and not any(a <= t < b for a, b in trace.gaps):
            times.append(t)
    return times


def render(trace: Trace, seed: int) -> dict[str, object]:
    rng = random.Random(seed)
    times = poll_times(trace, rng)
    processes = []
    for proc in trace.procs:
        used: list[int | None] = []
        sm: list[float | None] = []
        for t in times:
            value = proc.used(t)
            if value is None:
                used.append(None)
                sm.append(None)
                continue
            noisy = value + (rng.gauss(0, proc.noise_mib) * MIB if proc.noise_mib else 0)
            used.append(max(0, round(noisy / MIB)))
            ratio = proc.sm(t)
            sm.append(None if ratio is None else round(ratio * 100))
        processes.append(
            {
                "pid": proc.pid,
                "start_time": T0 + proc.start,
                "used_mib": used,
                "sm_percent": sm,
                "dead_after_ms": None if proc.dead_after is None else round(proc.dead_after * 1000),
            }
        )
    extra = trace.unattributed
    return {
        "name": trace.name,
        "description": trace.description,
        "seed": seed,
        "poll_seconds": trace.poll,
        "drift_seconds": trace.drift,
        "jitter_ratio": 0.03,
        "gaps": [list(g) for g in trace.gaps],
        "duration_seconds": trace.duration,
        "gpu_total_bytes": trace.total,
        "t0": T0,
        "t_ms": [round(t * 1000) for t in times],
        "unattributed_mib": None
        if extra is None
        else [round((extra(t) or 0) / MIB) for t in times],
        "processes": processes,
        "expect": trace.expect,
    }


def main() -> None:
    for old in HERE.glob("*.json"):
        old.unlink()
    total = 0
    for seed, trace in enumerate(catalog()):
        path = HERE / f"{trace.name}.json"
        path.write_text(json.dumps(render(trace, seed), separators=(",", ":")) + "\n")
        total += path.stat().st_size
    print(f"wrote {len(catalog())} traces, {total / 2**20:.2f} MiB")


if __name__ == "__main__":
    main()
