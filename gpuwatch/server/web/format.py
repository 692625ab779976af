"""How the pages write numbers and times: binary sizes (as nvidia-smi does), UTC times.

Times are shown in UTC everywhere, charts included, so a time read off a chart is the
time in a table and in the API (epoch seconds).
"""

from __future__ import annotations

import time
from html import escape
from urllib.parse import quote, urlencode

from gpuwatch.terminal_text import printable

_KIB = 2**10


def size(value: int | float | None) -> str:
    """``21474836480`` -> ``"20.0 GiB"``; None -> ``"–"`` (unknown, never 0)."""
    if value is None:
        return "–"
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", _KIB)):
        if abs(value) >= scale:
            return f"{value / scale:.1f} {unit}"
    return f"{int(value)} B"


def when(t: float | None) -> str:
    """``"2027-01-15 08:00:00Z"``; None -> ``"–"``."""
    if t is None:
        return "–"
    try:
        return time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime(t))
    except (OverflowError, OSError, ValueError):
        # inf, NaN or past the platform's calendar (a stored 1e308): one odd cell,
        # not a page that answers 500.
        return "out of range"


def duration(seconds: float | None) -> str:
    """``5400`` -> ``"1 h 30 min"``; coarse, for "how long" columns."""
    if seconds is None:
        return "–"
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.0f} s"
    minutes = int(seconds // 60)
    if minutes < 60:
        return f"{minutes} min"
    hours, minutes = divmod(minutes, 60)
    if hours < 48:
        return f"{hours} h {minutes} min" if minutes else f"{hours} h"
    return f"{hours // 24} d {hours % 24} h"


def ago(t: float | None, now: float) -> str:
    return "never" if t is None else f"{duration(now - t)} ago"


def clock_label(t: float, span: float) -> str:
    """An axis label: the time of day, with the date when the axis spans days, and the
    date alone, with its year, when it spans months."""
    if span <= 86400:
        pattern = "%H:%M"
    elif span <= 90 * 86400:
        pattern = "%m-%d %H:%M"
    else:
        pattern = "%Y-%m-%d"
    return time.strftime(pattern, time.gmtime(t))


def ratio(used: int | None, total: int | None) -> str:
    if used is None or not total:
        return "–"
    return f"{used / total:.0%}"


def path(root: str, *segments: str | int) -> str:
    """A link inside the dashboard: ``root`` (the ASGI root path) and each segment
    percent-encoded (hostnames come from agents), HTML-escaped for an attribute."""
    return escape(root + "/" + "/".join(quote(str(s), safe="") for s in segments))


# Path segments a browser (and most HTTP clients) resolves away before sending the
# request, whether spelled as dots or as "%2e": no path can name a host called so.
DOT_SEGMENTS = frozenset({".", ".."})


def host_path(root: str, hostname: str, gpu_index: int | str | None = None) -> str:
    """The link to a host's page, or to one of its GPUs' pages, HTML-escaped for an
    attribute: ``/hosts/NAME[/gpus/N]`` with the name percent-encoded as one segment
    (the views read it from the raw path, so "/" in a name is never a separator), or
    ``/hosts/?name=NAME[&gpu=N]`` for a name no path segment can carry ("." and "..")."""
    if hostname in DOT_SEGMENTS:
        query = {"name": hostname} | ({} if gpu_index is None else {"gpu": str(gpu_index)})
        return escape(f"{root}/hosts/?{urlencode(query)}")
    if gpu_index is None:
        return path(root, "hosts", hostname)
    return path(root, "hosts", hostname, "gpus", gpu_index)


def gpus_prefix(root: str, hostname: str) -> str:
    """What a GPU index is appended to for the link to that GPU of ``hostname`` (the
    fleet page's script builds its tiles' links so), HTML-escaped."""
    if hostname in DOT_SEGMENTS:
        return escape(f"{root}/hosts/?{urlencode({'name': hostname, 'gpu': ''})}")
    return path(root, "hosts", hostname) + "/gpus/"


def tooltip(value: str) -> str:
    """Agent-sent text for a ``title`` (an attribute or an SVG ``<title>``), which no
    ``<bdi>`` can isolate: direction overrides and other invisible characters shown as
    escapes (``\\u202e``), then HTML-escaped."""
    return escape(printable(value))
