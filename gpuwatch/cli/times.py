"""A point in time as a person types it on the command line: epoch seconds, or an ISO
8601 time (local when it names no zone)."""

from __future__ import annotations

import math
from datetime import datetime


def epoch_or_iso(text: str) -> float:
    """``text`` as epoch seconds. Raises ``ValueError`` for anything else, including a
    number no server can take ("nan", "inf", "1e309": not a time, and not JSON) and a
    date at the calendar's ends, where ``astimezone`` and ``timestamp`` overflow
    (0001-01-01 local)."""
    text = text.strip()
    try:
        seconds = float(text)
    except ValueError:
        pass
    else:
        if not math.isfinite(seconds):
            raise ValueError(f"{text!r} is not a finite number of seconds")
        return seconds
    parsed = datetime.fromisoformat(text)
    try:
        return (parsed if parsed.tzinfo else parsed.astimezone()).timestamp()
    except OverflowError as err:
        raise ValueError(f"{text!r} is past the calendar's ends") from err
