"""Which browsers' requests a gpuwatch HTTP listener answers: its ``Host`` names and the
``Origin`` of the requests that change something.

Both the agent's port (:mod:`gpuwatch.agent.exporter`) and the server
(:mod:`gpuwatch.server.app`) default to listening on loopback, where nothing but this
host can connect; but a web page open in a browser on this host can. Two ways:

* **DNS rebinding.** A page from ``http://evil.example:9402`` whose name the attacker
  then re-resolves to ``127.0.0.1`` reads and writes the listener as its own origin.
  The browser still sends ``Host: evil.example:9402``: a listener bound to loopback
  answers only a ``Host`` that names a loopback address, ``localhost``, or one of the
  operator's ``allowed_hosts`` (421 otherwise). A listener bound to another or the
  wildcard address is reached by real names and protected by its tokens and the
  network: it answers any ``Host`` unless ``allowed_hosts`` is set, and then those
  names, ``localhost`` and IP addresses (a rebinding attack needs a name it controls).
* **Cross-site requests.** A page from another origin can POST a "simple" request
  (``text/plain``, a form) without a CORS preflight. A request that changes something
  (POST, PUT, PATCH, DELETE) carrying an ``Origin`` that is not the listener's own
  host and port (nor one of ``allowed_hosts``), ``Origin: null``, or
  ``Sec-Fetch-Site: cross-site``/``same-site`` is refused with 403. gpuwatch's own
  clients (agents pushing, the command line) send no ``Origin``; the dashboard's own
  forms send their own.

Only the standard library: the agent imports this.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

# 421: the request was sent to a server that is not the one its Host names (RFC 9110
# §15.5.20); a client may retry elsewhere, a rebinding page cannot.
MISDIRECTED = 421
FORBIDDEN = 403
STATE_CHANGING = frozenset({"POST", "PUT", "PATCH", "DELETE"})
# What the operator may list in allowed_hosts: a host name or an IP address, no port
# (any port is accepted), or "*" for any Host.
_NAME = re.compile(r"[a-z0-9_](?:[a-z0-9_.-]{0,251}[a-z0-9_])?\.?")
_DEFAULT_PORTS = {"http": 80, "https": 443}
_MAX_SHOWN = 80


def allowed_host_names(values: Iterable[str]) -> list[str]:
    """``values`` as ``allowed_hosts`` keeps them: lower case, without a trailing dot
    or IPv6 brackets. Raises ValueError for an entry that is not a host name, an IP
    address or ``*`` (a port, a scheme or a path: the check takes any port)."""
    names = []
    for value in values:
        name = value.strip().lower()
        if name.startswith("[") and name.endswith("]"):
            name = name[1:-1]
        if name != "*" and _ip(name) is None and not _NAME.fullmatch(name):
            raise ValueError(
                f"allowed_hosts: {_shown(value)} is not a host name or IP address "
                "(give names without scheme, port or path; any port is accepted)"
            )
        names.append(name.rstrip("."))
    return names


def bound_to_loopback(host: str) -> bool:
    """True when a listener bound to ``host`` (an address or a name) can be reached
    only from this machine: every address the name resolves to is loopback."""
    host = host.strip("[]").lower().rstrip(".")
    if host == "localhost":
        return True
    if not host or _ip(host) is not None:
        return is_loopback_address(host)
    try:
        found = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return False
    return bool(found) and all(is_loopback_address(str(entry[4][0])) for entry in found)


@dataclass(frozen=True)
class RequestGuard:
    """The Host and cross-site rules of one listener (the module docstring).

    ``setting`` names the allow-list in messages (``[agent] allowed_hosts``)."""

    loopback: bool
    names: frozenset[str] = frozenset()
    setting: str = "allowed_hosts"

    @classmethod
    def for_listener(
        cls, bind_host: str, names: Iterable[str] = (), *, setting: str = "allowed_hosts"
    ) -> RequestGuard:
        return cls(bound_to_loopback(bind_host), frozenset(allowed_host_names(names)), setting)

    def refusal(
        self,
        method: str,
        host: str | None,
        origin: str | None,
        fetch_site: str | None,
    ) -> tuple[int, str] | None:
        """``(status, one-line reason)`` for a request to refuse, else ``None``."""
        reason = self.host_refusal(host)
        if reason is not None:
            return MISDIRECTED, reason
        if method.upper() in STATE_CHANGING:
            reason = self.cross_site_refusal(host, origin, fetch_site)
            if reason is not None:
                return FORBIDDEN, reason
        return None

    def host_refusal(self, host: str | None) -> str | None:
        """Why a request with this ``Host`` header is refused, or ``None``."""
        if not self.loopback and not self.names:
            return None  # reached by real names; its tokens and the network protect it
        if host is None or "*" in self.names:
            return None  # no Host: not a browser, which always sends one
        parsed = _split_host(host)
        if parsed is None:
            return f"malformed Host header {_shown(host)}"
        name, _port = parsed
        if name == "localhost" or is_loopback_address(name) or name in self.names:
            return None
        if not self.loopback and _ip(name) is not None:
            return None
        where = "a loopback listener" if self.loopback else "this listener"
        return (
            f"Host {_shown(host)} is not a name of {where}: use localhost or a loopback "
            f"address, or add the name to {self.setting}"
        )

    def cross_site_refusal(
        self, host: str | None, origin: str | None, fetch_site: str | None
    ) -> str | None:
        """Why a state-changing request from this ``Origin`` / ``Sec-Fetch-Site`` is
        refused, or ``None``."""
        site = (fetch_site or "").strip().lower()
        if site in ("cross-site", "same-site"):
            return f"cross-site request refused (Sec-Fetch-Site: {site})"
        if origin is None:
            return None  # not sent by a browser (agents, the command line)
        own = _origin_address(origin)
        if own is None:
            return f"cross-origin request refused (Origin: {_shown(origin)})"
        scheme, origin_host, origin_port = own
        if origin_host in self.names:
            return None  # the operator's name for this listener (behind a proxy)
        target = None if host is None else _split_host(host)
        if target is not None:
            target_host, target_port = target
            if target_port is None:
                target_port = _DEFAULT_PORTS[scheme]
            if (target_host, target_port) == (origin_host, origin_port):
                return None
        return (
            f"cross-origin request refused: Origin {_shown(origin)} is not "
            f"{_shown(host or '')} (add a proxy's public name to {self.setting})"
        )


def _split_host(value: str) -> tuple[str, int | None] | None:
    """``Host`` header -> (lower-case name or address, port or None); None if malformed."""
    value = value.strip()
    if value.startswith("["):
        end = value.find("]")
        if end < 0:
            return None
        name, rest = value[1:end], value[end + 1 :]
        if _ip(name) is None or (rest and not rest.startswith(":")):
            return None
        port_text = rest[1:]
    else:
        name, _, port_text = value.partition(":")
        if ":" in port_text:
            return None  # an IPv6 address without brackets
    if port_text and not (port_text.isascii() and port_text.isdigit() and len(port_text) <= 5):
        return None
    name = name.lower().rstrip(".")
    if not name or any(c in name for c in " \t/\\@?#%"):
        return None
    return name, int(port_text) if port_text else None


def _origin_address(origin: str) -> tuple[str, str, int] | None:
    """``Origin`` -> (scheme, host, port); None for ``null``, another scheme, or junk."""
    try:
        parts = urlsplit(origin.strip())
        port = parts.port
    except ValueError:
        return None
    scheme = parts.scheme.lower()
    if scheme not in _DEFAULT_PORTS or not parts.hostname or parts.path not in ("", "/"):
        return None
    return scheme, parts.hostname.lower().rstrip("."), port or _DEFAULT_PORTS[scheme]


def _ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        return None


def unmapped(
    address: ipaddress.IPv4Address | ipaddress.IPv6Address,
) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """``address``, or the IPv4 address an IPv4-mapped IPv6 one stands for: a
    dual-stack listener (``[::]``) sees a local IPv4 client as ``::ffff:127.0.0.1``."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def is_loopback_address(text: str) -> bool:
    """Whether ``text`` is a loopback address, IPv4-mapped IPv6 included (:func:`unmapped`)."""
    address = _ip(text)
    return address is not None and unmapped(address).is_loopback


def _shown(value: str) -> str:
    """``value`` quoted for a one-line message: control characters escaped, bounded."""
    if len(value) > _MAX_SHOWN:
        value = value[: _MAX_SHOWN - 3] + "..."
    return ascii(value)
