"""Short human texts about culprits and sizes, shared by the Slack and Alertmanager receivers.

Sizes are binary units (``30.0 GiB``), growth is per minute (``+1.2 GiB/min``), the
way a person reads ``nvidia-smi`` output, not bytes per second.
"""

from __future__ import annotations

from gpuwatch.containers import shown_container_id
from gpuwatch.server.notifications.model import Culprit
from gpuwatch.terminal_text import printable

_UNITS = (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))
COMMAND_CHARS = 80


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
    text = printable(" ".join(text.split()))
    return text if len(text) <= limit else text[: limit - 1] + "…"


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
    if culprit.slurm_job_id:
        facts.append(f"Slurm job {culprit.slurm_job_id}")
    if culprit.pod_uid:
        facts.append(f"pod {culprit.pod_uid}")
    if culprit.container_id:
        facts.append(f"container {shown_container_id(culprit.container_id)}")
    return facts


def culprit_line(culprit: Culprit) -> str:
    """One plain-text line: ``alice: python train.py (30.0 GiB, +1.2 GiB/min, pid 42, pod …)``."""
    who = culprit.user or "unknown user"
    command = shorten(culprit.command or "unknown command", COMMAND_CHARS)
    return f"{who}: {command} ({', '.join(culprit_facts(culprit))})"


def culprits_text(culprits: list[Culprit], *, limit: int = 1024) -> str:
    """All culprits on one line, ``; ``-separated, cut at ``limit`` characters."""
    return shorten("; ".join(culprit_line(c) for c in culprits), limit)
