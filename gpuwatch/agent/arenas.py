"""Cap glibc's malloc arenas in the agent process.

glibc gives threads that contend for the heap arenas of their own, up to eight per
core, each kept at its high-water mark. The agent runs about ten threads (HTTP
workers, the poll loop, the push thread) that each allocate a little: measured over
10,000 scrapes (bench/README.md, "Agent RSS"), two arenas hold its RSS about 0.6 MiB
lower, and growing more slowly, than the default. This is what ``MALLOC_ARENA_MAX=2``
does, set from inside so that every way of running the
agent (systemd, a container, ``gpuwatch demo``) gets it.
"""

from __future__ import annotations

import ctypes
import logging
import os

log = logging.getLogger(__name__)

M_ARENA_MAX = -8  # glibc's <malloc.h>
AGENT_ARENAS = 2


def limit_malloc_arenas(arenas: int = AGENT_ARENAS) -> bool:
    """Cap the arenas threads may create from now on; call it before starting any.

    True when the C library took it; False where there is no glibc ``mallopt`` (musl,
    macOS), which leaves the allocator as it was. A ``MALLOC_ARENA_MAX`` set in the
    environment wins, as an operator's explicit choice.
    """
    if "MALLOC_ARENA_MAX" in os.environ:
        return False
    try:
        # The process's own symbols: the C library Python runs on.
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    taken = mallopt(M_ARENA_MAX, arenas) == 1
    if not taken:
        log.debug("mallopt(M_ARENA_MAX, %d) refused", arenas)
    return taken
