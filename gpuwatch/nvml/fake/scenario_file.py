"""Read a scenario TOML file (or a bundled scenario by name) into a :class:`Scenario`.

Every key is documented in ``docs/scenarios.md``. Anything wrong raises
:class:`~gpuwatch.errors.ScenarioError` with one line naming the file and the field,
e.g. ``leak.toml: process[0].memory: unknown size unit in '2Gb' (use B, KiB, ...)``.
Unknown keys are errors too, so a typo never silently becomes a default.
"""

from __future__ import annotations

import hashlib
import os
import tomllib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal, TypeVar, cast

from gpuwatch.errors import ScenarioError
from gpuwatch.nvml.fake.quantities import parse_bytes, parse_seconds
from gpuwatch.nvml.fake.scenario import (
    Attach,
    FaultKind,
    FaultSpec,
    Ghost,
    GpuSpec,
    MigSpec,
    ProcessKind,
    ProcessSpec,
    Scenario,
    Spawn,
)
from gpuwatch.nvml.fake.timeline import Constant, Timeline, parse_timeline

T = TypeVar("T")
D = TypeVar("D")

# Same ceilings as gpuwatch.snapshot (not imported: this package must stay stdlib-only,
# because it is injected into third-party programs).
MAX_GPUS = 64
MAX_MIG_INSTANCES = 7
MAX_PROCESSES_PER_GPU = 1024
MAX_PID = 2**22
# Real stand-in processes cost ~10 MiB each; beyond this, use ghost PIDs (see docs).
MAX_STANDINS = 64
MAX_SPEED = 10_000.0
MAX_COMMAND_BYTES = 4096  # gpuwatch.snapshot keeps commands up to 4096 characters
MAX_LIFETIME_SECONDS = 7 * 86400.0
DEFAULT_LIFETIME_SECONDS = 8 * 3600.0
MAX_HANG_SECONDS = 300.0

_FAULT_KINDS: tuple[FaultKind, ...] = ("gpu_lost", "unsupported", "no_permission", "hang")
_PROCESS_KINDS: tuple[ProcessKind, ...] = ("compute", "graphics", "mps")


def bundled_scenario_dir() -> Path:
    """The directory of scenarios shipped with gpuwatch (package data)."""
    return Path(__file__).with_name("scenarios")


def bundled_scenario_names() -> list[str]:
    """Names ``install()`` and the CLI accept instead of a path, e.g. ``"workstation"``."""
    return sorted(p.stem for p in bundled_scenario_dir().glob("*.toml"))


def resolve_scenario_path(source: str | os.PathLike[str]) -> Path:
    """A path to an existing file, or a bundled scenario name, -> the file to read.

    Raises ScenarioError when it is neither.
    """
    path = Path(source)
    if path.is_file():
        return path
    text = os.fspath(source)
    if os.sep in text or text.endswith(".toml"):
        raise ScenarioError(f"scenario file {text} does not exist")
    bundled = bundled_scenario_dir() / f"{text}.toml"
    if bundled.is_file():
        return bundled
    names = ", ".join(bundled_scenario_names())
    raise ScenarioError(
        f"unknown scenario {text!r}: not a file, and not a bundled scenario ({names})"
    )


def load_scenario(
    source: str | os.PathLike[str], *, known_symbols: Callable[[str], bool] | None = None
) -> Scenario:
    """Read and check a scenario. ``known_symbols`` validates fault ``function`` names.

    Raises ScenarioError (exit code 3 in the CLI) for any problem with the file.
    """
    path = resolve_scenario_path(source)
    try:
        raw = path.read_bytes()
        document = tomllib.loads(raw.decode("utf-8"))
    except (OSError, UnicodeDecodeError) as err:
        raise ScenarioError(f"cannot read scenario file {path}: {err}") from err
    except tomllib.TOMLDecodeError as err:
        raise ScenarioError(f"{path.name}: not valid TOML: {err}") from err
    reader = _ScenarioReader(path, known_symbols or (lambda _name: True))
    return reader.read(document, hashlib.sha256(raw).hexdigest())


class _Table:
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

    def tables(self, key: str) -> list[_Table]:
        self.seen.add(key)
        items = self.data.get(key, [])
        if not isinstance(items, list):
            raise self.error(key, f"must be an array of tables ([[{key}]])")
        prefix = f"{self.where}.{key}" if self.where else key
        return [_Table(item, f"{prefix}[{i}]", self.file) for i, item in enumerate(items)]

    def done(self) -> None:
        unknown = sorted(set(self.data) - self.seen)
        if unknown:
            raise self.error(unknown[0], "unknown key (see docs/scenarios.md)")


def _string(value: object) -> str:
    if not isinstance(value, str):
        raise ValueError(f"expected a string, got {value!r}")
    return value


def _boolean(value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"expected true or false, got {value!r}")
    return value


def _number(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"expected a number, got {value!r}")
    return float(value)


def _index(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"expected an integer >= 0, got {value!r}")
    return value


def _bytes_timeline(value: object) -> Timeline:
    return parse_timeline(value, lambda v: float(parse_bytes(v)))


def _ranged_timeline(low: float, high: float) -> Callable[[object], Timeline]:
    def parse(value: object) -> Timeline:
        timeline = parse_timeline(value, _number)
        lowest, highest = timeline.bounds()
        if lowest < low or highest > high:
            raise ValueError(f"values must stay within {low:g}..{high:g}")
        return timeline

    return parse


_PERCENT = _ranged_timeline(0, 100)


def _derived_id(kind: str, *parts: object) -> str:
    """A stable UUID-shaped id from the scenario name and position, e.g. ``GPU-1a2b...``."""
    digest = hashlib.sha256("/".join(str(p) for p in parts).encode()).hexdigest()
    return f"{kind}-{digest[:8]}-{digest[8:12]}-{digest[12:16]}-{digest[16:20]}-{digest[20:32]}"


class _ScenarioReader:
    def __init__(self, path: Path, known_symbols: Callable[[str], bool]) -> None:
        self.path = path
        self.known_symbols = known_symbols

    def read(self, document: dict[str, Any], content_hash: str) -> Scenario:
        top = _Table(document, "", self.path)
        fake = _Table(top.get("fake", lambda v: v, {}), "fake", self.path)
        name = fake.get("name", _string, self.path.stem)
        speed = fake.get("speed", _number, 1.0)
        if not 0 < speed <= MAX_SPEED:
            raise fake.error("speed", f"must be > 0 and <= {MAX_SPEED:g}")
        lifetime = fake.get("lifetime", parse_seconds, DEFAULT_LIFETIME_SECONDS)
        if not 0 < lifetime <= MAX_LIFETIME_SECONDS:
            raise fake.error("lifetime", "must be longer than 0s and at most 7d")
        driver = fake.get("driver_version", _string, "550.54.15")
        scenario = Scenario(
            name=name,
            description=fake.get("description", _string, ""),
            source=self.path,
            content_hash=content_hash,
            speed=speed,
            lifetime=lifetime,
            driver_version=driver,
            nvml_version=fake.get("nvml_version", _string, f"12.{driver}"),
            cuda_driver_version=fake.get("cuda_driver_version", _index, 12040),
            gpus=tuple(self._gpu(t, i, name) for i, t in enumerate(top.tables("gpu"))),
            processes=(),
            faults=(),
        )
        fake.done()
        if not scenario.gpus:
            raise top.error("gpu", "a scenario needs at least one [[gpu]]")
        if len(scenario.gpus) > MAX_GPUS:
            raise top.error("gpu", f"at most {MAX_GPUS} GPUs")
        processes = self._processes(top.tables("process"), scenario)
        faults = tuple(self._fault(t, scenario) for t in top.tables("fault"))
        top.done()
        return Scenario(**{**scenario.__dict__, "processes": processes, "faults": faults})

    def _gpu(self, table: _Table, index: int, scenario_name: str) -> GpuSpec:
        total = table.require("memory_total", parse_bytes)
        reserved = table.get("reserved", parse_bytes, min(total // 160, 512 * 2**20))
        if reserved >= total:
            raise table.error("reserved", "must be less than memory_total")
        mig = tuple(
            self._mig(t, i, index, scenario_name) for i, t in enumerate(table.tables("mig"))
        )
        if len(mig) > MAX_MIG_INSTANCES:
            raise table.error("mig", f"at most {MAX_MIG_INSTANCES} MIG instances")
        if sum(m.memory_total for m in mig) > total - reserved:
            raise table.error("mig", "MIG instances add up to more than memory_total - reserved")
        capability = table.get("cuda_capability", _string, "9.0")
        major, _, minor = capability.partition(".")
        if not (major.isdigit() and minor.isdigit()):
            raise table.error("cuda_capability", f'expected "MAJOR.MINOR", got {capability!r}')
        spec = GpuSpec(
            index=index,
            name=table.get("name", _string, "NVIDIA H100 80GB HBM3"),
            uuid=table.get("uuid", _string, _derived_id("GPU", scenario_name, index)),
            pci_bus_id=table.get("pci_bus_id", _string, f"00000000:{index + 1:02X}:00.0"),
            pci_device_id=table.get("pci_device_id", _index, 0x233010DE),
            memory_total=total,
            memory_reserved=reserved,
            unattributed=table.get("unattributed", _bytes_timeline, Constant(0)),
            power_limit_watts=table.get("power_limit_watts", _number, 700.0),
            power_watts=table.get("power_watts", _ranged_timeline(0, 100_000), None),
            temperature_celsius=table.get("temperature_celsius", _ranged_timeline(-100, 300), None),
            utilization_percent=table.get("utilization_percent", _PERCENT, None),
            memory_busy_percent=table.get("memory_busy_percent", _PERCENT, None),
            fan_percent=table.get("fan_percent", _PERCENT, Constant(30)),
            clock_sm_mhz=table.get("clock_sm_mhz", _index, 1980),
            clock_memory_mhz=table.get("clock_memory_mhz", _index, 2619),
            bar1_total=table.get("bar1_total", parse_bytes, 128 * 2**30),
            cuda_capability=(int(major), int(minor)),
            coherent=table.get("coherent", _boolean, False),
            persistence_mode=table.get("persistence_mode", _boolean, True),
            display_active=table.get("display_active", _boolean, False),
            mig=mig,
        )
        table.done()
        return spec

    def _mig(self, table: _Table, index: int, gpu: int, scenario_name: str) -> MigSpec:
        spec = MigSpec(
            index=index,
            profile=table.require("profile", _string),
            uuid=table.get("uuid", _string, _derived_id("MIG", scenario_name, gpu, index)),
            memory_total=table.require("memory_total", parse_bytes),
            gpu_instance_id=table.get("gpu_instance_id", _index, index + 1),
            compute_instance_id=table.get("compute_instance_id", _index, 0),
        )
        table.done()
        return spec

    def _processes(self, tables: list[_Table], scenario: Scenario) -> tuple[ProcessSpec, ...]:
        processes = [p for entry, t in enumerate(tables) for p in self._process(t, entry, scenario)]
        standins = sum(isinstance(p.origin, Spawn) for p in processes)
        if standins > MAX_STANDINS:
            raise ScenarioError(
                f"{self.path.name}: process: {standins} spawned stand-ins, at most {MAX_STANDINS} "
                "(use ghost = PID with count = N for large process counts)"
            )
        for gpu in scenario.gpus:
            if len(scenario.processes_on(gpu.index)) > MAX_PROCESSES_PER_GPU:
                raise ScenarioError(
                    f"{self.path.name}: process: more than {MAX_PROCESSES_PER_GPU} on GPU {gpu.index}"
                )
        # A GPU lists each PID once; the same ghost may hold memory on several GPUs.
        seen: set[tuple[int, int]] = set()
        for p in processes:
            if isinstance(p.origin, Ghost):
                if (p.gpu, p.origin.pid) in seen:
                    raise ScenarioError(
                        f"{self.path.name}: process[{p.entry}]: ghost PID {p.origin.pid} repeats on GPU {p.gpu}"
                    )
                seen.add((p.gpu, p.origin.pid))
        return tuple(processes)

    def _process(self, table: _Table, entry: int, scenario: Scenario) -> list[ProcessSpec]:
        gpu = table.require("gpu", _index)
        if gpu >= len(scenario.gpus):
            raise table.error("gpu", f"no GPU {gpu} (the scenario has {len(scenario.gpus)})")
        mig = table.get("mig", _index, None)
        if mig is not None and mig >= len(scenario.gpus[gpu].mig):
            raise table.error("mig", f"GPU {gpu} has no MIG instance {mig}")
        count = table.get("count", _index, 1)
        if not 1 <= count <= MAX_PROCESSES_PER_GPU:
            raise table.error("count", f"must be 1..{MAX_PROCESSES_PER_GPU}")
        origins = self._origins(table, count)
        kind = table.get("kind", _string, "compute")
        if kind not in _PROCESS_KINDS:
            raise table.error("kind", f"must be one of {', '.join(_PROCESS_KINDS)}, got {kind!r}")
        start = table.get("start", parse_seconds, 0.0)
        exit_at = table.get("exit", parse_seconds, None)
        if exit_at is not None and exit_at <= start:
            raise table.error("exit", "must be later than start")
        memory = table.get("memory", _bytes_timeline, Constant(0))
        if memory.bounds()[1] > scenario.gpus[gpu].memory_total:
            raise table.error("memory", "is larger than the GPU's memory_total")
        sm_percent = table.get("sm_percent", _PERCENT, Constant(0))
        memory_busy = table.get("memory_busy_percent", _PERCENT, None)
        not_available = table.get("memory_not_available", _boolean, False)
        table.done()
        return [
            ProcessSpec(
                entry=entry,
                copy=copy,
                gpu=gpu,
                mig=mig,
                origin=origin,
                kind=cast(ProcessKind, kind),
                memory=memory,
                sm_percent=sm_percent,
                memory_busy_percent=memory_busy,
                start=start,
                exit=exit_at,
                memory_not_available=not_available,
            )
            for copy, origin in enumerate(origins)
        ]

    def _origins(self, table: _Table, count: int) -> list[Spawn | Attach | Ghost]:
        given = [key for key in ("spawn", "attach", "ghost") if table.has(key)]
        if len(given) != 1:
            raise table.error(
                "", 'needs exactly one of spawn = [...], attach = PID|"self"|"parent", ghost = PID'
            )
        if given[0] != "spawn":
            for key in ("env", "orphan"):
                if table.has(key):
                    raise table.error(key, "only applies to spawn = [...] processes")
        if given[0] == "spawn":
            argv = table.require("spawn", _argv)
            env = table.get("env", _environment, ())
            orphan = table.get("orphan", _boolean, False)
            return [Spawn(argv, env, orphan) for _ in range(count)]
        if given[0] == "ghost":
            pid = table.require("ghost", _pid)
            if pid + count - 1 > MAX_PID:
                raise table.error("count", f"ghost PIDs would pass {MAX_PID}")
            return [Ghost(pid + copy) for copy in range(count)]
        target = table.require("attach", _attach_target)
        if count != 1:
            raise table.error("count", "an attached PID cannot repeat; use ghost = PID for copies")
        return [Attach(target)]

    def _fault(self, table: _Table, scenario: Scenario) -> FaultSpec:
        gpu = table.get("gpu", _index, None)
        if gpu is not None and gpu >= len(scenario.gpus):
            raise table.error("gpu", f"no GPU {gpu} (the scenario has {len(scenario.gpus)})")
        kind = table.require("kind", _string)
        if kind not in _FAULT_KINDS:
            raise table.error("kind", f"must be one of {', '.join(_FAULT_KINDS)}, got {kind!r}")
        functions = table.get("function", _symbols, ())
        if kind == "gpu_lost":
            if functions:
                raise table.error(
                    "function", "gpu_lost applies to every call on the GPU; drop function"
                )
            if gpu is None:
                raise table.error("gpu", "gpu_lost needs the index of the GPU that is lost")
        elif not functions:
            raise table.error("function", f'{kind} needs function = "nvmlDevice..." (or a list)')
        for name in functions:
            if not self.known_symbols(name):
                raise table.error("function", f"the fake library has no NVML function {name!r}")
        seconds = table.get("seconds", _number, 0.0)
        if kind == "hang" and not 0 < seconds <= MAX_HANG_SECONDS:
            raise table.error("seconds", f"hang needs seconds = N, 0 < N <= {MAX_HANG_SECONDS:g}")
        if kind != "hang" and table.has("seconds"):
            raise table.error("seconds", 'only applies to kind = "hang"')
        spec = FaultSpec(
            gpu=gpu,
            kind=cast(FaultKind, kind),
            functions=functions,
            at=table.get("at", parse_seconds, 0.0),
            duration=table.get("duration", parse_seconds, None),
            seconds=seconds,
        )
        table.done()
        return spec


def _argv(value: object) -> tuple[str, ...]:
    if not isinstance(value, list) or not value or not all(isinstance(a, str) for a in value):
        raise ValueError('expected a command as a list of strings, e.g. ["python", "train.py"]')
    if any("\0" in a for a in value) or not value[0]:
        raise ValueError("command arguments cannot contain NUL and the program cannot be empty")
    if sum(len(a.encode()) + 1 for a in value) > MAX_COMMAND_BYTES:
        raise ValueError(f"the command is longer than {MAX_COMMAND_BYTES} bytes")
    return tuple(value)


def _environment(value: object) -> tuple[tuple[str, str], ...]:
    if not isinstance(value, Mapping) or not all(isinstance(v, str) for v in value.values()):
        raise ValueError('expected a table of strings, e.g. env = { SLURM_JOB_ID = "4242" }')
    for key, item in value.items():
        if not key or "=" in key or "\0" in key or "\0" in item:
            raise ValueError(f"invalid environment variable {key!r}")
    return tuple(sorted(value.items()))


def _pid(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_PID:
        raise ValueError(f"expected a PID 1..{MAX_PID}, got {value!r}")
    return value


def _attach_target(value: object) -> int | Literal["self", "parent"]:
    if value == "self" or value == "parent":
        return value
    return _pid(value)


def _symbols(value: object) -> tuple[str, ...]:
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
        raise ValueError(
            'expected an NVML function name or a list of them, e.g. "nvmlDeviceGetPowerUsage"'
        )
    return tuple(names)
