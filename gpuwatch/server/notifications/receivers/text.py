"""Short human texts about culprits and sizes, shared by the Slack and Alertmanager receivers.

Sizes are binary units (``30.0 GiB``), growth is per minute (``+1.2 GiB/min``), the
way a person reads ``nvidia-smi`` output, not bytes per second.
"""

from __future__ import annotations

import re

from gpuwatch.containers import shown_container_id
from gpuwatch.server.notifications.model import Culprit
from gpuwatch.terminal_text import printable

_UNITS = (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))
COMMAND_CHARS = 80
# A user name or an id (Slurm job, pod, container) as a receiver shows it: ingest takes
# up to 256 characters of each, from whoever holds a host token.
NAME_CHARS = 64
# The escapes terminal_text.printable writes (\x1b, \u202e, \U0001f600, \n), whole
# or cut short at the end of a text.
_ESCAPE_TAIL = re.compile(r"\\(x[0-9a-f]{0,2}|u[0-9a-f]{0,4}|U[0-9a-f]{0,8}|[nrt]?)$")
_ESCAPE_LENGTH = {"x": 4, "u": 6, "U": 10}


def format_bytes(value: float) -> str:
    """``32212254720`` -> ``30.0 GiB``; below 1 KiB, plain bytes."""
    size = abs(value)
    sign = "-" if value < 0 else ""
    for unit, scale in _UNITS:
        if size >= scale:
            return f"{sign}{size / scale:.1f} {unit}"
    return f"{sign}{size:.0f} B"


def format_rate(bytes_per_second: float) -> str:
    """Growth per minute with its sign: ``+1.2 GiB/min``."""
    per_minute = bytes_per_second * 60
    sign = "+" if per_minute >= 0 else "-"
    return f"{sign}{format_bytes(abs(per_minute))}/min"


def shorten(text: str, limit: int) -> str:
    """``text`` on one line of at most ``limit`` characters: whitespace runs (newlines
    too) made one space, other control and bidi characters escaped (a command line
    is anyone's to write)."""
    return cut(printable(" ".join(text.split())), limit)


def cut(text: str, limit: int) -> str:
    """``text`` in at most ``limit`` characters, ending with ``…`` when cut, and never
    inside an escape :func:`~gpuwatch.terminal_text.printable` wrote: half of
    ``\\u202e`` (``\\u20…``) reads as garbage, or as another character."""
    if len(text) <= limit:
        return text
    head = text[: limit - 1]
    tail = _ESCAPE_TAIL.search(head)
    if tail is not None:
        start = tail.start()
        whole = _ESCAPE_LENGTH.get(text[start + 1 : start + 2], 2)
        if start + whole > len(head):  # the escape goes on past the cut
            head = head[:start]
    return head + "…"


def short_name(text: str | None, default: str) -> str:
    """A user name or an id as receivers show it: one line, control and bidi
    characters escaped, at most :data:`NAME_CHARS` characters."""
    return shorten(text, NAME_CHARS) if text else default


def culprit_facts(culprit: Culprit) -> list[str]:
    """What we know of a culprit besides its user and command, most telling first."""
    facts = []
    if culprit.memory_bytes is not None:
        facts.append(format_bytes(culprit.memory_bytes))
    # Only a floor that rose: a culprit that grew the GPU by arriving (a new worker)
    # has slope 0, and "+0 B/min" under "growing" is a figure nobody measured. The
    # webhook's description (rules.describe) leaves it out alike.
    if culprit.slope_bytes_per_second is not None and culprit.slope_bytes_per_second > 0:
        facts.append(format_rate(culprit.slope_bytes_per_second))
    facts.append(f"pid {culprit.pid}")
    # Ids come from the agent (any host token holder): one line each, bounded.
    if culprit.slurm_job_id:
        facts.append(f"Slurm job {short_name(culprit.slurm_job_id, '?')}")
    if culprit.pod_uid:
        facts.append(f"pod {short_name(culprit.pod_uid, '?')}")
    if culprit.container_id:
        facts.append(f"container {short_name(shown_container_id(culprit.container_id), '?')}")
    return facts


def culprit_line(culprit: Culprit) -> str:
    """One plain-text line: ``alice: python train.py (30.0 GiB, +1.2 GiB/min, pid 42, pod …)``."""
    who = short_name(culprit.user, "unknown user")
    command = shorten(culprit.command or "unknown command", COMMAND_CHARS)
    return f"{who}: {command} ({', '.join(culprit_facts(culprit))})"


def culprits_text(culprits: list[Culprit], *, limit: int = 1024) -> str:
    """All culprits on one line, ``; ``-separated, cut at ``limit`` characters."""
    return shorten("; ".join(culprit_line(c) for c in culprits), limit)
