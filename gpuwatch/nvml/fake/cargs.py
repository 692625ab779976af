"""Reading and writing the ctypes arguments pynvml passes to C functions.

pynvml calls a C symbol like ``fn(handle, byref(c_count), c_procs)``; the fake gets the
same Python objects. ``byref(x)`` is a ``CArgObject`` whose ``._obj`` is ``x``; a
``POINTER`` has ``.contents``; arrays, structs and string buffers arrive as themselves;
``None`` is C's NULL. Device handles are ``POINTER(struct_c_nvmlDevice_t)`` values
whose address the fake chooses (a token, never dereferenced).
"""

from __future__ import annotations

import ctypes
from typing import Any

# Handle tokens: 0x6770_GGMM, GG the GPU index and MM the MIG index + 1 (0: the GPU).
_TOKEN_BASE = 0x6770_0000
_TOKEN_MASK = 0xFFFF_0000


def target(arg: Any) -> Any:
    """The object an out-argument refers to (``byref(x)`` / ``pointer(x)`` -> ``x``)."""
    if type(arg).__name__ == "CArgObject":
        return arg._obj
    if isinstance(arg, ctypes._Pointer):
        return arg.contents
    return arg


def value(arg: Any) -> Any:
    """The plain value of an input argument (``c_uint(3)`` -> 3, ``c_char_p(b"x")`` -> b"x")."""
    obj = target(arg)
    return obj.value if isinstance(obj, ctypes._SimpleCData) else obj


def store(arg: Any, number: int) -> None:
    """Write ``number`` through an out-argument such as ``byref(c_uint())``."""
    target(arg).value = number


def write_text(buffer: Any, length: Any, text: str) -> bool:
    """Copy ``text`` NUL-terminated into a ``create_string_buffer``; False when it does
    not fit in ``length`` bytes (the caller returns NVML_ERROR_INSUFFICIENT_SIZE)."""
    encoded = text.encode()
    if buffer is None or len(encoded) + 1 > min(int(value(length)), len(target(buffer))):
        return False
    target(buffer).value = encoded
    return True


def fill(struct: Any, **fields: Any) -> None:
    """Set the named fields that ``struct`` has (v1 structs lack some v2 fields)."""
    names = {name for name, *_ in type(struct)._fields_}
    for name, item in fields.items():
        if name in names:
            setattr(struct, name, item)


def handle_token(gpu: int, mig: int | None) -> int:
    return _TOKEN_BASE | (gpu << 8) | (0 if mig is None else mig + 1)


def set_handle(arg: Any, token: int) -> None:
    """Make the ``c_nvmlDevice_t`` behind ``arg`` hold the address ``token``."""
    ctypes.c_void_p.from_buffer(target(arg)).value = token


def decode_handle(handle: Any) -> tuple[int, int | None] | None:
    """``(gpu, mig)`` for a handle the fake issued, None for anything else."""
    try:
        address = ctypes.cast(handle, ctypes.c_void_p).value
    except (ctypes.ArgumentError, TypeError):
        return None
    if address is None or address & _TOKEN_MASK != _TOKEN_BASE:
        return None
    low = address & 0xFF
    return (address >> 8) & 0xFF, (low - 1 if low else None)
