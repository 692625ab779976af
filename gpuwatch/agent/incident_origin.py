"""Who posted to the agent: the local user behind a loopback connection.

Any local user can post an incident to ``POST /incidents/oom``, and the agent forwards
it under the host's token; so the agent says who did, as the kernel knows it (the
owner of the client's socket in ``/proc/net/tcp``), not as the body claims. The same
uid decides whether an allocator report on ``POST /torch`` may speak for its process
(:func:`gpuwatch.agent.procinfo.process_uid`, :meth:`IncidentOrigin.speaks_for`).
"""

from __future__ import annotations

import ipaddress
import pwd
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuwatch.host_origin import unmapped


@dataclass(frozen=True)
class IncidentOrigin:
    """Who posted an OOM incident: always this host (loopback), and which user.

    Any local user can post one, and the agent forwards it under the host's token, so
    the event says it was reported by the agent from a local process, with the
    poster's uid as the kernel knows it (``/proc/net/tcp``), not as the body claims.
    """

    peer_address: str
    peer_uid: int | None
    peer_user: str | None
    reported_by: str = "agent-local"

    @classmethod
    def of_peer(
        cls, client: tuple[str, int], local: tuple[str, int], *, proc_root: Path
    ) -> IncidentOrigin:
        """The origin of a request from ``client`` to this agent's ``local`` address."""
        uid = tcp_peer_uid(client, local, proc_root=proc_root)
        return cls(f"{client[0]}:{client[1]}", uid, _user_name(uid))

    def speaks_for(self, uid: int | None) -> bool:
        """True when the poster may report on a process owned by ``uid``: it is that
        user, or root. An unknown poster or owner speaks for no one."""
        if self.peer_uid is None or uid is None:
            return False
        return self.peer_uid in (0, uid)

    def evidence(self) -> dict[str, Any]:
        return {
            "reported_by": self.reported_by,
            "reporter_uid": self.peer_uid,
            "reporter_user": self.peer_user,
        }


def tcp_peer_uid(
    client: tuple[str, int], server: tuple[str, int], *, proc_root: Path = Path("/proc")
) -> int | None:
    """The uid owning the client end of a local TCP connection, from ``/proc/net/tcp{,6}``.

    On loopback both ends are this host's sockets: the client's row has ``local_address``
    = client and ``rem_address`` = server. ``None`` when not found or not readable, and
    when the client end is no longer an open connection a process holds (state
    ESTABLISHED, a socket inode): a socket its owner closed (FIN_WAIT, TIME_WAIT) is
    listed with uid 0 and inode 0, and a poster that sent its request and closed at once
    would otherwise pass for root.
    """
    try:
        local = unmapped(ipaddress.ip_address(client[0]))
        remote = unmapped(ipaddress.ip_address(server[0]))
    except ValueError:
        return None
    if local.version != remote.version:
        return None
    table = "tcp" if local.version == 4 else "tcp6"
    want = (_proc_net_address(local, client[1]), _proc_net_address(remote, server[1]))
    try:
        lines = (proc_root / "net" / table).read_text(encoding="ascii").splitlines()[1:]
    except (OSError, UnicodeDecodeError):
        return None
    for line in lines:
        fields = line.split()
        if (
            len(fields) > 9
            and (fields[1], fields[2]) == want
            and fields[3] == _ESTABLISHED
            and fields[7].isdigit()
            and fields[9].isdigit()
            and int(fields[9]) != 0
        ):
            return int(fields[7])
    return None


# /proc/net/tcp's ``st`` column for an open connection (include/net/tcp_states.h).
_ESTABLISHED = "01"


def _proc_net_address(address: ipaddress.IPv4Address | ipaddress.IPv6Address, port: int) -> str:
    # The kernel prints each 32-bit word of the address in host byte order, in hex.
    packed = address.packed
    words = struct.unpack(f"={len(packed) // 4}I", packed)
    return "".join(f"{word:08X}" for word in words) + f":{port:04X}"


def _user_name(uid: int | None) -> str | None:
    if uid is None:
        return None
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return None
