"""The history as the agent serves it: ``GET /reaper/history`` (``?pid=N``).

:func:`history_report` builds the body from the agent's
:class:`~gpuwatch.agent.reaper.history.ProcessHistory`; :func:`fetch_history` is how
``gpuwatch reap --agent URL`` reads it back. The body is strict and bounded: the
command line takes it from another process.

Times are on the agent's steady clock (:mod:`gpuwatch.agent.reaper.clock`):
``CLOCK_BOOTTIME`` plus ``clock_offset_seconds``, which the reader adds to its own
``CLOCK_BOOTTIME`` to get "now" on the same clock, whatever the wall clock did. Without
an offset (an agent before this field) they are epoch seconds. Start times are epoch
seconds computed from ``boot_time``, the ``btime`` the agent read at its start; a
reader whose ``btime`` differs (the wall clock stepped since) shifts its own start
times by the difference before matching (:meth:`HistoryReport.lookups`).
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import pwd
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gpuwatch.agent.reaper.history import Activity, ProcessHistory, Run
from gpuwatch.agent.reaper.procfs import same_start
from gpuwatch.errors import RemoteError
from gpuwatch.host_origin import unmapped
from gpuwatch.snapshot import MAX_BYTES, MAX_PID, ShortStr

if TYPE_CHECKING:
    import httpx

HISTORY_PATH = "/reaper/history"
# 64 GPUs x 1024 processes; runs per track as many as the settings allow.
MAX_TRACKS = 65536
MAX_RUNS = 4096


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RunOut(_Strict):
    start: float
    end: float
    activity: Activity
    low_bytes: Annotated[int, Field(ge=0, le=MAX_BYTES)] | None
    high_bytes: Annotated[int, Field(ge=0, le=MAX_BYTES)] | None
    busiest_ratio: Annotated[float, Field(ge=0, le=1)] = 0.0
    cpu_busy: bool = False

    def to_run(self) -> Run:
        return Run(
            self.start,
            self.end,
            self.activity,
            self.low_bytes,
            self.high_bytes,
            self.busiest_ratio,
            self.cpu_busy,
        )


class TrackOut(_Strict):
    gpu_index: Annotated[int, Field(ge=0, lt=64)]
    gpu_uuid: ShortStr
    pid: Annotated[int, Field(ge=0, le=MAX_PID)]
    start_time: float | None
    last_seen: float
    runs: Annotated[list[RunOut], Field(max_length=MAX_RUNS)]


class HistoryReport(_Strict):
    """``GET /reaper/history``: the agent's runs per process and GPU (times on its
    steady clock; see the module docstring)."""

    schema_version: Literal[1] = 1
    hostname: ShortStr
    boot_id: ShortStr
    generated_at: float
    # Steady clock = CLOCK_BOOTTIME + this; None: the times are epoch seconds.
    clock_offset_seconds: float | None = None
    # The btime (epoch s) the agent's start times are computed from; None: unknown.
    boot_time: float | None = None
    poll_interval_seconds: float
    cover_seconds: float
    history_seconds: float
    max_gap_seconds: float
    tracks: Annotated[list[TrackOut], Field(max_length=MAX_TRACKS)]

    def runs_for(self, gpu_uuid: str, pid: int, start_time: float | None) -> list[Run] | None:
        """The runs of that process on that GPU, or ``None`` when the agent has none.

        Start times must agree to the clock tick (:func:`~gpuwatch.agent.reaper.procfs.same_start`):
        a reused PID is another process with no history. An unknown start time matches
        nothing, since it cannot tell a reused PID apart.
        """
        if start_time is None:
            return None
        for track in self.tracks:
            if (
                track.gpu_uuid == gpu_uuid
                and track.pid == pid
                and same_start(track.start_time, start_time)
            ):
                return [r.to_run() for r in track.runs]
        return None

    def gpus_for(self, pid: int, start_time: float | None) -> list[tuple[int, str]]:
        """The GPUs ``(index, uuid)`` the agent has that process on (start times matched
        as in :meth:`runs_for`)."""
        return sorted(
            (t.gpu_index, t.gpu_uuid)
            for t in self.tracks
            if t.pid == pid and same_start(t.start_time, start_time)
        )

    def start_shift(self, local_boot_time: float | None) -> float:
        """What to add to a start time computed from ``local_boot_time`` to get the
        agent's: both are ``btime + ticks / CLK_TCK``, so they differ by the two btimes
        (``/proc/stat`` moves btime with every wall-clock step; the agent read its own
        once, at its start). 0 when either is unknown."""
        if self.boot_time is None or local_boot_time is None:
            return 0.0
        return self.boot_time - local_boot_time

    def lookups(self, local_boot_time: float | None) -> tuple[RunsFor, GpusFor]:
        """:meth:`runs_for` and :meth:`gpus_for` for start times computed from
        ``local_boot_time`` (:meth:`start_shift`)."""
        shift = self.start_shift(local_boot_time)

        def runs_for(gpu_uuid: str, pid: int, start_time: float | None) -> list[Run] | None:
            return self.runs_for(gpu_uuid, pid, None if start_time is None else start_time + shift)

        def gpus_for(pid: int, start_time: float | None) -> list[tuple[int, str]]:
            return self.gpus_for(pid, None if start_time is None else start_time + shift)

        return runs_for, gpus_for

    def now_on_its_clock(self, wall: Callable[[], float], boot: Callable[[], float]) -> float:
        """The reader's "now" on the clock these times are on (module docstring)."""
        if self.clock_offset_seconds is None:
            return wall()
        return boot() + self.clock_offset_seconds


RunsFor = Callable[[str, int, "float | None"], "list[Run] | None"]
GpusFor = Callable[[int, "float | None"], "list[tuple[int, str]]"]


def fetch_history(
    url: str,
    *,
    pid: int | None = None,
    timeout: float = 5.0,
    transport: httpx.BaseTransport | None = None,
) -> HistoryReport:
    """The local agent's history from ``url`` (its base URL).

    Raises :class:`~gpuwatch.errors.RemoteError` when the agent is unreachable, answers
    an error, or sends something that is not a history.
    """
    import httpx  # here, not at the top: the agent process does without httpx

    target = url.rstrip("/") + HISTORY_PATH
    params = {"pid": str(pid)} if pid is not None else None
    try:
        # Never through a proxy (HTTP_PROXY and friends): the history must come from the
        # socket on this host that the caller checked (verify_agent), not from whoever
        # the proxy reaches.
        with httpx.Client(timeout=timeout, transport=transport, trust_env=False) as client:
            response = client.get(target, params=params)
    except (httpx.HTTPError, httpx.InvalidURL) as err:
        raise RemoteError(f"no gpuwatch agent at {url} ({type(err).__name__})") from err
    if response.status_code != 200:
        raise RemoteError(
            f"the agent at {url} answered HTTP {response.status_code} for {HISTORY_PATH}"
        )
    try:
        return HistoryReport.model_validate_json(response.content)
    except ValidationError as err:
        raise RemoteError(
            f"the agent at {url} sent an invalid history ({err.error_count()} errors)"
        ) from err


def history_report(
    history: ProcessHistory,
    *,
    hostname: str,
    boot_id: str,
    generated_at: float,
    pid: int | None = None,
    clock_offset_seconds: float | None = None,
    boot_time: float | None = None,
) -> HistoryReport:
    """Everything ``history`` keeps (or only ``pid``'s tracks), as the agent serves it.
    ``generated_at`` is on the history's clock; ``clock_offset_seconds`` says which
    that is (``None``: epoch seconds) and ``boot_time`` is the btime of its start times."""
    return HistoryReport(
        hostname=hostname,
        boot_id=boot_id,
        generated_at=generated_at,
        clock_offset_seconds=clock_offset_seconds,
        boot_time=boot_time,
        poll_interval_seconds=history.poll_interval_seconds,
        cover_seconds=history.cover_seconds,
        history_seconds=history.history_seconds,
        max_gap_seconds=history.max_gap_seconds,
        tracks=[
            TrackOut(
                gpu_index=t.gpu_index,
                gpu_uuid=t.gpu_uuid,
                pid=t.pid,
                start_time=t.start_time,
                last_seen=t.last_seen,
                runs=[
                    RunOut(
                        start=r.start,
                        end=r.end,
                        activity=r.activity,
                        low_bytes=r.low_bytes,
                        high_bytes=r.high_bytes,
                        busiest_ratio=r.busiest_ratio,
                        cpu_busy=r.cpu_busy,
                    )
                    for r in t.runs
                ],
            )
            for t in history.tracks(pid)
        ],
    )


# -- who serves the history ------------------------------------------------------------

_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp{,6}
AGENT_SERVICE_USER = "gpuwatch"  # User= of deploy/systemd/gpuwatch-agent.service


@dataclass(frozen=True)
class Listener:
    """One listening TCP socket on this host: its owner's uid and socket inode."""

    uid: int
    inode: int


def _address(hex_address: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """``0100007F`` -> 127.0.0.1: /proc/net/tcp{,6} print each 32-bit word in host
    (little-endian) order."""
    raw = bytes.fromhex(hex_address)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return ipaddress.ip_address(words)


def listeners(port: int, addresses: set[str], proc_root: Path = Path("/proc")) -> list[Listener]:
    """The sockets listening on ``port`` that a connection to one of ``addresses``
    could reach: bound to one of them, or to the wildcard address when one of them is
    an address of this host (:func:`is_local`). A wildcard listener takes connections
    to this host's own addresses only: for any other address the connection goes to
    another host, whatever listens here on that port."""
    found = []
    local: bool | None = None  # whether one of ``addresses`` is local; asked when needed
    for table in ("tcp", "tcp6"):
        try:
            lines = (proc_root / "net" / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 10 or fields[3] != _LISTEN:
                continue
            hex_address, _, hex_port = fields[1].partition(":")
            if int(hex_port, 16) != port:
                continue
            address = _address(hex_address)
            if address.is_unspecified and local is None:
                local = any(is_local(a) for a in addresses)
            named = str(address) in addresses or str(unmapped(address)) in addresses
            if named or (address.is_unspecified and local):
                found.append(Listener(uid=int(fields[7]), inode=int(fields[9])))
    return found


def is_local(address: str) -> bool:
    """True when ``address`` (an IP address, IPv6 with its ``%scope``) is a loopback
    address or one assigned to this host: one a socket can be bound to here. A bind to
    anything else fails with EADDRNOTAVAIL; ``ip_nonlocal_bind`` would let it succeed,
    so then the address must also be what the kernel routes to as its own (the source
    it picks to reach it is the address itself)."""
    import socket

    try:
        ip = ipaddress.ip_address(address.partition("%")[0])
    except ValueError:
        return False
    if ip.is_loopback:
        return True
    if ip.is_unspecified or ip.is_multicast:
        return False
    family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
    try:
        info = socket.getaddrinfo(address, 0, family, socket.SOCK_DGRAM, 0, socket.AI_NUMERICHOST)
        sockaddr = info[0][4]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.bind(sockaddr)
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((sockaddr[0], 9, *sockaddr[2:]))  # UDP: nothing is sent
            return ipaddress.ip_address(str(probe.getsockname()[0]).partition("%")[0]) == ip
    except OSError:  # EADDRNOTAVAIL: not ours; or no route to it at all
        return False


def trusted_uids(caller_uid: int | None = None) -> set[int]:
    """Who may serve the history: root, and the agent's service user when it exists
    (systemd's DynamicUser= resolves it while the unit runs); and ``caller_uid``, a
    caller who can signal only its own processes (its own agent, as in ``gpuwatch
    demo``): a history it made up could only get its own processes stopped."""
    uids = {0}
    with contextlib.suppress(KeyError):  # no such user: root alone
        uids.add(pwd.getpwnam(AGENT_SERVICE_USER).pw_uid)
    if caller_uid is not None:
        uids.add(caller_uid)
    return uids


class _NoHost(ValueError):
    pass


def url_addresses(url: str) -> tuple[set[str], int]:
    """The addresses ``url``'s host resolves to (none when it does not resolve), and
    its port. Raises :class:`ValueError` when ``url`` is not a URL with a host."""
    import socket
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    host, port = parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)
    if not host:
        raise _NoHost(url)
    try:
        return {str(info[4][0]) for info in socket.getaddrinfo(host, port, proto=6)}, port
    except OSError:
        return set(), port


def verify_agent(
    url: str, proc_root: Path = Path("/proc"), *, caller_uid: int | None = None
) -> list[Listener]:
    """The listeners on this host behind ``url``, all owned by a trusted uid.

    Anyone can listen on a free local port and serve a made-up history, and hostname
    and boot id are public, so the history is used only when the socket serving it
    belongs to root or the agent's service user, which an unprivileged user cannot
    fake, or to ``caller_uid`` (a caller that may signal only its own processes).
    Raises :class:`~gpuwatch.agent.reaper.errors.ReapRefused` when a listener belongs
    to anyone else, or when the URL's host resolves to an address that is not this
    host's (:func:`is_local`: a wildcard listener here says nothing about it). An empty
    list: nothing listens there on this host (the caller must not use an answer from
    such a URL)."""
    from gpuwatch.agent.reaper.errors import ReapRefused

    try:
        addresses, port = url_addresses(url)
    except _NoHost:
        raise ReapRefused(f"--agent {url}: not a URL with a host") from None
    except ValueError as err:
        raise ReapRefused(f"--agent {url}: not a URL ({err})") from None
    # Every address the name resolves to must be this host's: a connection may go to
    # any of them, and one elsewhere is another host's word, not this agent's.
    elsewhere = sorted(a for a in addresses if not is_local(a))
    if elsewhere:
        raise ReapRefused(
            f"--agent {url}: {elsewhere[0]} is not an address of this host, and only this "
            "host's agent may say what is idle here; refusing"
        )
    found = listeners(port, addresses, proc_root) if addresses else []
    trusted = trusted_uids(caller_uid)
    for listener in found:
        if listener.uid not in trusted:
            yours = "" if caller_uid is None else ", nor by you"
            raise ReapRefused(
                f"the history at {url} is served by uid {listener.uid}, not by root or the "
                f"{AGENT_SERVICE_USER} service user{yours}: it cannot be trusted; refusing"
            )
    return found


def socket_pids(inodes: set[int], proc_root: Path = Path("/proc")) -> set[int]:
    """PIDs holding one of these socket inodes open (those this caller may look at)."""
    targets = {f"socket:[{inode}]" for inode in inodes}
    pids = set()
    for entry in proc_root.iterdir() if inodes else ():
        if not entry.name.isdigit():
            continue
        try:
            for fd in (entry / "fd").iterdir():
                if os.readlink(fd) in targets:
                    pids.add(int(entry.name))
                    break
        except OSError:
            continue
    return pids
