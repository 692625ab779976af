"""Byte sizes as OOM messages print them, and back.

Every framework that prints sizes in an OOM message uses binary multiples, whatever
the suffix says: PyTorch's ``format_size`` prints ``KiB``/``MiB``/``GiB`` (1 KiB = 1024 B),
the MPS backend printed ``KB``/``MB``/``GB`` with the same binary meaning until 2024-25,
TensorFlow's ``HumanReadableNumBytes`` prints ``90.48M`` or ``7.81G`` and XLA ``2.99GiB``.
So ``MB`` here is 1,048,576 bytes, never 1,000,000.

Conversions are exact (``Decimal``) and rounded half-up to whole bytes, so a printed
``1.19 GiB`` becomes 1,277,752,771 bytes, and :func:`format_size` followed by
:func:`parse_size` round-trips within the printed precision (half a unit of the last
printed digit).
"""

from __future__ import annotations

import re
from decimal import ROUND_HALF_UP, Decimal, InvalidOperation

KIB = 1024
MIB = 1024**2
GIB = 1024**3
TIB = 1024**4

# NVML and the CUDA caching allocator print 2**64 bytes ("17179869184.00 GiB") when
# a value is not available or no limit is set; it is never a real amount of memory.
NOT_AVAILABLE_BYTES = 2**64
# No device has 1 EiB: a request this large is a corrupt (negative or overflowed) size.
ABSURD_REQUEST_BYTES = 2**60

_UNIT_BYTES: dict[str, int] = {
    "b": 1,
    "byte": 1,
    "bytes": 1,
    "k": KIB,
    "kb": KIB,
    "kib": KIB,
    "m": MIB,
    "mb": MIB,
    "mib": MIB,
    "g": GIB,
    "gb": GIB,
    "gib": GIB,
    "t": TIB,
    "tb": TIB,
    "tib": TIB,
    "p": 1024**5,
    "pb": 1024**5,
    "pib": 1024**5,
    "e": 1024**6,
    "eb": 1024**6,
    "eib": 1024**6,
}

# One size token: a number (thousands separators allowed, as CuPy prints them) and a
# unit. Single-letter units are TensorFlow's; the lookahead stops "5 Megapixel" or
# "2 GPUs" from reading as sizes. No nested quantifiers: matching is linear.
SIZE_PATTERN = (
    r"(?P<num>\d[\d,]*(?:\.\d+)?)\s?"
    r"(?P<unit>[KMGTPE]i?B|[KMGTPE]|[Bb]ytes?|B)(?![A-Za-z])"
)
_SIZE_RE = re.compile(rf"\s*{SIZE_PATTERN}\s*")


def unit_bytes(unit: str) -> int:
    """Bytes in one ``unit`` (``"MiB"`` -> 1048576). Raises ``KeyError`` if unknown."""
    return _UNIT_BYTES[unit.lower()]


def size_to_bytes(number: str, unit: str) -> int:
    """Exact bytes of ``number`` ``unit`` (``"1.19", "GiB"`` -> 1277752771).

    Thousands separators in ``number`` are ignored. Raises ``ValueError`` if the
    number or unit cannot be read.
    """
    try:
        value = Decimal(number.replace(",", ""))
        multiple = unit_bytes(unit)
    except (InvalidOperation, KeyError) as err:
        raise ValueError(f"not a size: {number!r} {unit!r}") from err
    return int((value * multiple).to_integral_value(rounding=ROUND_HALF_UP))


def parse_size(text: str) -> int:
    """Bytes of one whole size string such as ``"20.00 MiB"``, ``"7.81G"`` or ``"0 bytes"``.

    Raises ``ValueError`` if ``text`` is not exactly one size.
    """
    match = _SIZE_RE.fullmatch(text)
    if match is None:
        raise ValueError(f"not a size: {text!r}")
    return size_to_bytes(match["num"], match["unit"])


def format_size(num_bytes: int) -> str:
    """Print bytes the way PyTorch's allocator does: ``"512 bytes"``, ``"1.50 GiB"``.

    Below 1 KiB whole bytes; then KiB, MiB or GiB with two decimals (GiB is the
    largest unit, as in PyTorch, so 4 TiB prints as ``"4096.00 GiB"``).
    """
    if num_bytes < KIB:
        return f"{num_bytes} bytes"
    for limit, unit, divisor in ((MIB, "KiB", KIB), (GIB, "MiB", MIB)):
        if num_bytes < limit:
            return f"{num_bytes / divisor:.2f} {unit}"
    if num_bytes >= NOT_AVAILABLE_BYTES**2:
        # Past what a float holds (a message can print any number of digits): exact.
        return f"{Decimal(num_bytes) / GIB:.2f} GiB"
    return f"{num_bytes / GIB:.2f} GiB"
