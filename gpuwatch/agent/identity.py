"""Who this agent is: a stable agent id, the hostname, and this boot's id."""

from __future__ import annotations

import socket
from pathlib import Path

from gpuwatch.agent.sampler import HostIdentity


def host_identity(
    agent_id: str | None,
    *,
    hostname: str | None = None,
    proc_root: Path = Path("/proc"),
    etc: Path = Path("/etc"),
) -> HostIdentity:
    """Build the identity that makes ``(agent_id, boot_id, sequence)`` unique.

    The hostname defaults to this machine's (``hostname`` overrides it: several
    simulated hosts on one machine, as in ``gpuwatch demo``). The agent id defaults to
    ``/etc/machine-id`` (stable across reboots and renames), then the hostname. The boot
    id changes on every boot, so a sequence that restarts from 1 after a reboot or
    restart is never mistaken for a retry.
    """
    hostname = hostname or socket.gethostname()
    if agent_id is None:
        try:
            agent_id = (etc / "machine-id").read_text().strip() or hostname
        except OSError:
            agent_id = hostname
    try:
        boot_id = (proc_root / "sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot_id = "unknown"
    return HostIdentity(agent_id=agent_id, hostname=hostname, boot_id=boot_id)
