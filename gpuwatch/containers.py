"""How a container id is shown to a person, the same in the agent and the server.

Most runtimes (Docker, containerd, CRI-O, Podman) give a container a 64-hex id, shown by
its first 12 characters as ``docker ps`` shows it. LXC/LXD/Incus give it a *name*
(``student-gpu-01``), which cut to 12 characters would show two containers as one
(``student-gpu-``): a name is shown whole, up to :data:`MAX_SHOWN_NAME_CHARS` (LXD's own
limit is 63; a directory name may be longer).
"""

from __future__ import annotations

import re

SHORT_ID_CHARS = 12
MAX_SHOWN_NAME_CHARS = 64
_HEX_ID = re.compile(r"[0-9a-f]{64}")


def shown_container_id(container_id: str) -> str:
    """``container_id`` as a person reads it: a 64-hex id's first 12 characters, a name
    whole (cut, with an ellipsis, past :data:`MAX_SHOWN_NAME_CHARS`)."""
    if _HEX_ID.fullmatch(container_id):
        return container_id[:SHORT_ID_CHARS]
    if len(container_id) <= MAX_SHOWN_NAME_CHARS:
        return container_id
    return container_id[: MAX_SHOWN_NAME_CHARS - 1] + "…"


def container_label(runtime: str | None, container_id: str) -> str:
    """``docker 0123456789ab``, ``lxc student-gpu-01``; ``container <id>`` when the
    runtime is unknown."""
    return f"{runtime or 'container'} {shown_container_id(container_id)}"
