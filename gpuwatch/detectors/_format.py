"""Human-readable sizes and durations for finding summaries (binary units, like nvidia-smi)."""

from __future__ import annotations

_GIB = 2**30
_MIB = 2**20


def format_bytes(value: int | float) -> str:
    """``21474836480`` -> ``"20.0 GiB"``; below 1 GiB in MiB."""
    if abs(value) >= _GIB:
        return f"{value / _GIB:.1f} GiB"
    return f"{value / _MIB:.1f} MiB"


def format_seconds(value: float) -> str:
    """``10800`` -> ``"3.0 h"``; ``90`` -> ``"1.5 min"``; below a minute in seconds."""
    if value >= 3600:
        return f"{value / 3600:.1f} h"
    if value >= 60:
        return f"{value / 60:.1f} min"
    return f"{value:.0f} s"
