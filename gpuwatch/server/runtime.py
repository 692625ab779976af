"""Interpreter tuning for the long-running ``gpuwatch server`` process."""

from __future__ import annotations

import gc
import logging
import resource

log = logging.getLogger(__name__)

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


# Open files a server process asks for: one per connection, plus the database's.
OPEN_FILES_WANTED = 65_536


def raise_open_files_limit() -> None:
    """Raise this process's soft limit on open files towards :data:`OPEN_FILES_WANTED`,
    within the hard limit.

    The soft limit is often 1,024 (systemd's default for services), and every agent's
    push is a connection: a fleet's reconnect storm, or connections opened on purpose,
    would reach it and the server could then accept no one. The hard limit (524,288
    under systemd) is what an administrator meant to allow. Only ever raised.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = OPEN_FILES_WANTED if hard == resource.RLIM_INFINITY else min(hard, OPEN_FILES_WANTED)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
        except (ValueError, OSError) as err:
            log.warning("could not raise the open-files limit from %d: %s", soft, err)
