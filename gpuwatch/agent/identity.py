"""Identities: who this agent is, and who a process's uid is.

**This agent**: a stable agent id, the hostname, and this boot's id (:func:`host_identity`).

**A uid** (:class:`UserNames`, :class:`UidMap`). ``/proc`` gives a process's real uid; the
name a person recognises has to come from somewhere that agrees with the host:

* *A user namespace* (rootless Docker or Podman with ``--pid=host``, userns-remap,
  ``PrivateUsers=yes``): the kernel shows every uid in the reader's namespace. Uids it cannot
  map read as the overflow uid (65534, ``/proc/sys/kernel/overflowuid``), which is not
  "nobody" but "unknown"; mapped ones are translated back through ``/proc/self/uid_map``
  into the parent namespace's (the host's, one level deep).
* *Subuids*: a rootless container's users (jovyan, uid 1000 inside) and every process of an
  unprivileged LXC/LXD/Incus container are host *subuids* such as 100999, which have no
  passwd entry. They belong to the user whose ``/etc/subuid`` range holds them, else to the
  user whose own service manager runs them (the host's ``user@<uid>.service``, at its own
  place in the process's cgroup: :mod:`gpuwatch.agent.cgroup`): that user is reported as the
  owner, while the uid stays the kernel's (the reaper checks permissions on the uid, never
  on the name).
* *The container image's passwd*: an agent in a container resolves names through the
  image's ``/etc/passwd``, which names other uids than the host's (the image's ``gpuwatch``
  account has uid 10001, a common first uid of a site's users). The image keeps a copy of
  its own file at :data:`IMAGE_PASSWD_COPY`; while ``/etc/passwd`` is still that file (the
  host's was not mounted over it), no name is looked up and every uid is shown as a number.
* *Failed lookups* are retried after :data:`NAME_RETRY_SECONDS`: NSS answers "no such user"
  and "directory unreachable" (sssd or LDAP restarting) alike, and a name cached as a number
  for the agent's life would outlast any outage. Names found are cached for good.
"""

from __future__ import annotations

import os
import pwd
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# Written by deploy/docker/Dockerfile: the image's own /etc/passwd, to tell it from a
# host's mounted over it.
IMAGE_PASSWD_COPY = Path("/usr/share/gpuwatch/image-passwd")
NAME_RETRY_SECONDS = 300.0
DEFAULT_OVERFLOW_UID = 65534
# The initial user namespace's map: every uid is itself.
_IDENTITY_MAP = ((0, 0, 4294967295),)
# Failed lookups remembered at once before the expired ones are swept.
_MAX_FAILURES = 1024


@dataclass(frozen=True)
class HostIdentity:
    """Who is polling: stable agent id, hostname, and this boot's id."""

    agent_id: str
    hostname: str
    boot_id: str


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


@dataclass(frozen=True, slots=True)
class UidMap:
    """The reader's user namespace: ``(inside, outside, count)`` ranges of its ``uid_map``."""

    ranges: tuple[tuple[int, int, int], ...] = _IDENTITY_MAP
    overflow_uid: int = DEFAULT_OVERFLOW_UID

    @property
    def nested(self) -> bool:
        """True when the reader runs in a user namespace (not the initial one)."""
        return self.ranges != _IDENTITY_MAP

    def outside(self, uid: int) -> int | None:
        """The uid ``uid`` (as ``/proc`` shows it to the reader) has in the parent namespace;
        ``None`` for the overflow uid, which stands for every uid the reader cannot map."""
        if not self.nested:
            return uid
        if uid == self.overflow_uid:
            return None
        for inside, outside, count in self.ranges:
            if inside <= uid < inside + count:
                return outside + (uid - inside)
        return None


def read_uid_map(proc_root: Path) -> UidMap:
    """The reader's :class:`UidMap`, from ``<proc_root>/self/uid_map``; the identity map when
    that cannot be read (no procfs there: nothing says the reader is in a namespace)."""
    try:
        text = (proc_root / "self" / "uid_map").read_text()
    except OSError:
        return UidMap()
    ranges: list[tuple[int, int, int]] = []
    for line in text.splitlines():
        fields = line.split()
        if len(fields) == 3 and all(f.isdigit() for f in fields):
            ranges.append((int(fields[0]), int(fields[1]), int(fields[2])))
    if not ranges:
        return UidMap()
    try:
        overflow = int((proc_root / "sys" / "kernel" / "overflowuid").read_text())
    except (OSError, ValueError):
        overflow = DEFAULT_OVERFLOW_UID
    return UidMap(tuple(ranges), overflow)


def _nss_name(uid: int) -> str:
    """The login name NSS gives ``uid``; raises KeyError when it gives none."""
    return pwd.getpwuid(uid).pw_name


class UserNames:
    """uid -> the name the host gives its owner, or the uid as a string (module docstring).

    ``lookup`` raises KeyError for a uid it cannot name (default: NSS); ``clock`` is
    monotonic seconds, for the retry of failed lookups. ``etc`` holds ``passwd`` (compared
    with ``image_passwd``) and ``subuid``. Not thread-safe: one ProcInfo owns one.
    """

    def __init__(
        self,
        *,
        etc: Path = Path("/etc"),
        image_passwd: Path = IMAGE_PASSWD_COPY,
        lookup: Callable[[int], str] = _nss_name,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._lookup = lookup
        self._clock = clock
        self._subuid = etc / "subuid"
        self._from_image = _same_file_contents(etc / "passwd", image_passwd)
        self._names: dict[int, str] = {}
        self._retry_at: dict[int, float] = {}
        self._ranges: tuple[tuple[str, int, int], ...] = ()
        self._ranges_read: tuple[int, int] | None = None

    @property
    def from_image(self) -> bool:
        """True when ``/etc/passwd`` is the container image's: no uid is named."""
        return self._from_image

    def name(self, uid: int, *, manager_uid: int | None = None) -> str:
        """The login name of ``uid``; for a subuid, its owner's (``/etc/subuid``, else
        ``manager_uid``: the uid whose ``user@<uid>.service`` runs the process), by name or
        else by number; else ``str(uid)``."""
        found = self._lookup_name(uid)
        if found is not None:
            return found
        owner = self._subuid_owner(uid)
        if owner is None and manager_uid is not None and manager_uid != uid:
            owner = self._lookup_name(manager_uid) or str(manager_uid)
        return owner or str(uid)

    def _lookup_name(self, uid: int) -> str | None:
        known = self._names.get(uid)
        if known is not None or self._from_image:
            return known
        now = self._clock()
        if now < self._retry_at.get(uid, now):
            return None
        try:
            name = self._lookup(uid)
        except KeyError:
            if len(self._retry_at) >= _MAX_FAILURES:
                self._retry_at = {u: t for u, t in self._retry_at.items() if t > now}
            self._retry_at[uid] = now + NAME_RETRY_SECONDS
            return None
        self._retry_at.pop(uid, None)
        self._names[uid] = name
        return name

    def _subuid_owner(self, uid: int) -> str | None:
        """Who ``/etc/subuid`` gives the range holding ``uid`` (``owner:start:count``; the
        owner is a name or a uid), named; ``None`` when no range holds it."""
        if self._from_image:
            return None  # the image's subuid file is not the host's either
        for owner, start, count in self._subuid_ranges():
            if start <= uid < start + count:
                if owner.isdigit():
                    return self._lookup_name(int(owner)) or owner
                return owner
        return None

    def _subuid_ranges(self) -> tuple[tuple[str, int, int], ...]:
        """The file's ranges, read again only when it changed (useradd adds ranges)."""
        try:
            st = os.stat(self._subuid)
            text = (
                self._subuid.read_text()
                if (st.st_mtime_ns, st.st_size) != self._ranges_read
                else None
            )
        except OSError:
            self._ranges, self._ranges_read = (), None
            return ()
        if text is not None:
            self._ranges_read = (st.st_mtime_ns, st.st_size)
            self._ranges = tuple(_parse_subuid(text))
        return self._ranges


def _parse_subuid(text: str) -> list[tuple[str, int, int]]:
    ranges = []
    for line in text.splitlines():
        owner, _, rest = line.strip().partition(":")
        start, _, count = rest.partition(":")
        if owner and not owner.startswith("#") and start.isdigit() and count.isdigit():
            ranges.append((owner, int(start), int(count)))
    return ranges


def _same_file_contents(path: Path, copy: Path) -> bool:
    try:
        return path.read_bytes() == copy.read_bytes()
    except OSError:
        return False
