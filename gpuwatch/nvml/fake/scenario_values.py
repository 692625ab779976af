"""Typed readers for scenario values, and the table walker that names fields in errors.

Each reader takes the raw TOML value and returns a checked Python value, or raises
ValueError/TypeError with a short reason; :class:`Table` turns that into a
:class:`~gpuwatch.errors.ScenarioError` naming the file and the field.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal, TypeVar

from gpuwatch.errors import ScenarioError
from gpuwatch.nvml.fake.timeline import Timeline, parse_timeline
from gpuwatch.quantities import parse_bytes

T = TypeVar("T")
D = TypeVar("D")

MAX_PID = 2**22  # Linux pid_max ceiling, as gpuwatch.snapshot
MAX_COMMAND_BYTES = 4096  # gpuwatch.snapshot keeps commands up to 4096 characters


class Table:
    """One TOML table being read: typed access by key, errors that name ``where.key``."""

    def __init__(self, data: object, where: str, file: Path) -> None:
        self.where, self.file = where, file
        if not isinstance(data, Mapping):
            raise self.error("", "must be a table")
        self.data: Mapping[str, Any] = data
        self.seen: set[str] = set()

    def error(self, key: str, message: str) -> ScenarioError:
        field = ".".join(part for part in (self.where, key) if part) or "top level"
        return ScenarioError(f"{self.file.name}: {field}: {message}")

    def has(self, key: str) -> bool:
        return key in self.data

    def get(self, key: str, parse: Callable[[Any], T], default: D) -> T | D:
        """``parse(value)``, or ``default`` when the key is absent."""
        return self._parse(key, parse) if key in self.data else self._skip(key, default)

    def require(self, key: str, parse: Callable[[Any], T]) -> T:
        if key not in self.data:
            raise self.error(key, "is required")
        return self._parse(key, parse)

    def _skip(self, key: str, default: D) -> D:
        self.seen.add(key)
        return default

    def _parse(self, key: str, parse: Callable[[Any], T]) -> T:
        self.seen.add(key)
        try:
            return parse(self.data[key])
        except (ValueError, TypeError) as err:
            raise self.error(key, str(err)) from None

    def tables(self, key: str) -> list[Table]:
        self.seen.add(key)
        items = self.data.get(key, [])
        if not isinstance(items, list):
            raise self.error(key, f"must be an array of tables ([[{key}]])")
        prefix = f"{self.where}.{key}" if self.where else key
        return [Table(item, f"{prefix}[{i}]", self.file) for i, item in enumerate(items)]

    def done(self) -> None:
        unknown = sorted(set(self.data) - self.seen)
        if unknown:
            raise self.error(unknown[0], "unknown key (see docs/scenarios.md)")


def string(value: object) -> str:
    if not isinstance(value, str):
        raise ValueError(f"expected a string, got {value!r}")
    return value


def boolean(value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"expected true or false, got {value!r}")
    return value


def number(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"expected a number, got {value!r}")
    return float(value)


def index(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"expected an integer >= 0, got {value!r}")
    return value


def bytes_timeline(value: object) -> Timeline:
    return parse_timeline(value, lambda v: float(parse_bytes(v)))


def ranged_timeline(low: float, high: float) -> Callable[[object], Timeline]:
    def parse(value: object) -> Timeline:
        timeline = parse_timeline(value, number)
        lowest, highest = timeline.bounds()
        if lowest < low or highest > high:
            raise ValueError(f"values must stay within {low:g}..{high:g}")
        return timeline

    return parse


PERCENT = ranged_timeline(0, 100)


def derived_id(kind: str, *parts: object) -> str:
    """A stable UUID-shaped id from the scenario name and position, e.g. ``GPU-1a2b...``."""
    digest = hashlib.sha256("/".join(str(p) for p in parts).encode()).hexdigest()
    return f"{kind}-{digest[:8]}-{digest[8:12]}-{digest[12:16]}-{digest[16:20]}-{digest[20:32]}"


def argv(value: object) -> tuple[str, ...]:
    if not isinstance(value, list) or not value or not all(isinstance(a, str) for a in value):
        raise ValueError('expected a command as a list of strings, e.g. ["python", "train.py"]')
    if any("\0" in a for a in value) or not value[0]:
        raise ValueError("command arguments cannot contain NUL and the program cannot be empty")
    if sum(len(a.encode()) + 1 for a in value) > MAX_COMMAND_BYTES:
        raise ValueError(f"the command is longer than {MAX_COMMAND_BYTES} bytes")
    return tuple(value)


def environment(value: object) -> tuple[tuple[str, str], ...]:
    if not isinstance(value, Mapping) or not all(isinstance(v, str) for v in value.values()):
        raise ValueError('expected a table of strings, e.g. env = { SLURM_JOB_ID = "4242" }')
    for key, item in value.items():
        if not key or "=" in key or "\0" in key or "\0" in item:
            raise ValueError(f"invalid environment variable {key!r}")
    return tuple(sorted(value.items()))


def pid(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_PID:
        raise ValueError(f"expected a PID 1..{MAX_PID}, got {value!r}")
    return value


def attach_target(value: object) -> int | Literal["self", "parent"]:
    if value == "self" or value == "parent":
        return value
    return pid(value)


def parse_bus_id(text: str) -> tuple[int, int, int, int] | None:
    """(domain, bus, device, function) of a PCI bus id in any form NVML takes, read as
    hex numbers: ``"domain:bus:device.function"``, ``"domain:bus:device"`` (function 0)
    or ``"bus:device.function"`` (domain 0). None: not a bus id."""
    head, dot, function = text.strip().partition(".")
    parts = head.split(":")
    if dot and len(parts) == 2:
        parts.insert(0, "0")
    if len(parts) != 3 or (not dot and text.count(".")):
        return None
    try:
        domain, bus, device = (int(part, 16) for part in parts)
        return domain, bus, device, int(function, 16) if dot else 0
    except ValueError:
        return None


def pci_bus_id(value: object) -> str:
    """A bus id in any form NVML takes, written as NVML writes it (``"00000000:18:00.0"``)."""
    text = string(value)
    address = parse_bus_id(text)
    limits = (0xFFFFFFFF, 0xFF, 0x1F, 7)  # domain, bus, device, function
    if address is None or any(n > top for n, top in zip(address, limits, strict=True)):
        raise ValueError(f'expected a PCI bus id like "00000000:18:00.0", got {text!r}')
    domain, bus, device, function = address
    return f"{domain:08X}:{bus:02X}:{device:02X}.{function:X}"


def mig_scope(value: object) -> int | Literal["parent"]:
    if value == "parent":
        return value
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f'expected "parent" or a MIG instance index >= 0, got {value!r}')
    return value


def symbols(value: object) -> tuple[str, ...]:
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
        raise ValueError(
            'expected an NVML function name or a list of them, e.g. "nvmlDeviceGetPowerUsage"'
        )
    return tuple(names)
