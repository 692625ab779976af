"""Why a path named by a person (``--config``, ``--fake-gpus``, ``GPUWATCH_CONFIG``)
cannot be read as a file, in words for the one-line error.

``Path.is_file()`` answers False for a directory, a FIFO or a missing file alike, and
raises for a name the kernel refuses (``File name too long``): callers that only asked
it either skipped the file silently or crashed. This says which it is, never raises.
"""

from __future__ import annotations

import stat
from pathlib import Path


def file_problem(path: Path) -> str | None:
    """None when ``path`` is a regular file (or a link to one); else why it is not one:
    ``"does not exist"``, ``"is a directory"``, ``"is not a regular file"`` (a FIFO would
    block the read, a device is not a config), or the system's reason (``File name too
    long``, ``Permission denied``)."""
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        return "does not exist"
    except (OSError, ValueError) as err:  # ValueError: a NUL byte in the name
        return getattr(err, "strerror", None) or str(err)
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISDIR(mode):
        return "is a directory"
    return "is not a regular file"
