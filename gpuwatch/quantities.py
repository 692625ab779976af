"""Sizes and durations as scenario files write them: ``"80GiB"``, ``"512MiB"``, ``"1h30m"``.

Both parsers accept a bare number too (bytes, seconds). They raise :class:`ValueError`
with a short reason; the scenario reader adds the file and field to it.
"""

from __future__ import annotations

import math
import re

# The largest byte figure any GPU reading may carry (1 PiB): snapshots refuse more, and
# a scenario says so at once rather than when its first snapshot is built.
MAX_BYTES = 2**50

# Binary and decimal units, as nvidia-smi (MiB) and vendors' spec sheets (GB) use them.
# Spelled exactly: "Gb" (gigabits) or "gib" are more likely mistakes than intentions.
_SIZE_UNITS = {
    "B": 1,
    "kB": 10**3,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KiB": 2**10,
    "MiB": 2**20,
    "GiB": 2**30,
    "TiB": 2**40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")

_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")


def parse_bytes(value: object) -> int:
    """``"80GiB"`` -> 85899345920. Ints are bytes; fractions round down to a byte.

    Raises ValueError for negative numbers, unknown units and non-numbers.
    """
    if isinstance(value, bool):
        raise ValueError(f"expected a size such as 80GiB, got {value!r}")
    if isinstance(value, int | float):
        number, unit = float(value), "B"
    elif isinstance(value, str) and (match := _SIZE.match(value)):
        number, unit = float(match.group(1)), match.group(2) or "B"
    else:
        raise ValueError(f"expected a size such as 80GiB, got {value!r}")
    if unit not in _SIZE_UNITS:
        raise ValueError(
            f"unknown size unit in {value!r} (use B, KiB, MiB, GiB, TiB, KB, MB, GB or TB)"
        )
    if not math.isfinite(number) or number < 0:
        raise ValueError(f"size must be a finite number >= 0, got {value!r}")
    return int(number * _SIZE_UNITS[unit])


def parse_seconds(value: object) -> float:
    """``"1h30m"`` -> 5400.0. Numbers are seconds; units are ms, s, m, h and d.

    Raises ValueError for negative numbers and anything that is not a duration.
    """
    shape = f"expected a duration such as 90s, 10m or 1h30m, got {value!r}"
    if isinstance(value, bool):
        raise ValueError(shape)
    if isinstance(value, int | float):
        seconds = float(value)
    elif isinstance(value, str) and value.strip():
        text = value.strip()
        parts = _DURATION_PART.findall(text)
        if "".join(number + unit for number, unit in parts) != text:
            raise ValueError(shape)
        seconds = sum(float(number) * _DURATION_UNITS[unit] for number, unit in parts)
    else:  # not a number, or an empty string
        raise ValueError(shape)
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"duration must be a finite number >= 0, got {value!r}")
    return seconds
