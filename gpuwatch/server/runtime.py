"""Interpreter tuning for the long-running ``gpuwatch server`` process."""

from __future__ import annotations

import gc

# CPython's defaults (700, 10, 10) suit short scripts. An ingest request allocates
# thousands of container objects (pydantic models, rows, dicts) that die with it,
# while the host-state cache keeps tens of thousands alive for the process's life; at
# the defaults the collector keeps re-walking that cache, and full collections were a
# third of the CPU of a 100-snapshot spool drain (bench/README.md). Collections still
# run, just less often: memory held by garbage cycles stays bounded.
GC_THRESHOLDS = (50_000, 20, 50)


def tune_gc() -> None:
    """Freeze what exists now (modules, routes, SQLAlchemy metadata: never garbage)
    out of the collector's sight, and raise its thresholds to :data:`GC_THRESHOLDS`.

    Call once, after the app is built and before serving.
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)
