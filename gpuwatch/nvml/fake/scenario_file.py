"""Read a scenario TOML file (or a bundled scenario by name) into a :class:`Scenario`.

Every key is documented in ``docs/scenarios.md``. Anything wrong raises
:class:`~gpuwatch.errors.ScenarioError` with one line naming the file and the field,
e.g. ``leak.toml: process[0].memory: unknown size unit in '2Gb' (use B, KiB, ...)``.
Unknown keys are errors too, so a typo never silently becomes a default.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast, get_args

from gpuwatch.errors import ScenarioError
from gpuwatch.files import file_problem
from gpuwatch.nvml.fake import scenario_values as values
from gpuwatch.nvml.fake.scenario import (
    INIT_FAULT_KINDS,
    INIT_FUNCTIONS,
    Attach,
    FaultKind,
    FaultSpec,
    Ghost,
    GpuSpec,
    MigScope,
    MigSpec,
    ProcessKind,
    ProcessSpec,
    Scenario,
    Spawn,
)
from gpuwatch.nvml.fake.scenario_health import read_health
from gpuwatch.nvml.fake.scenario_values import Table
from gpuwatch.nvml.fake.timeline import Constant
from gpuwatch.quantities import MAX_BYTES, parse_bytes, parse_seconds

# Same ceilings as gpuwatch.snapshot (not imported: it needs pydantic, and the fake runs
# inside third-party programs, so scenario reading sticks to the standard library).
MAX_GPUS = 64
MAX_MIG_INSTANCES = 7
MAX_PROCESSES_PER_GPU = 1024
# Real stand-in processes cost ~10 MiB each; beyond this, use ghost PIDs (see docs).
MAX_STANDINS = 64
MAX_SPEED = 10_000.0
MAX_LIFETIME_SECONDS = 7 * 86400.0
DEFAULT_LIFETIME_SECONDS = 8 * 3600.0
MAX_HANG_SECONDS = 300.0

# "550.54.15", "535.104.05", "470.82"; what nvmlSystemGetDriverVersion answers.
_DRIVER_VERSION = re.compile(r"\d{2,4}\.\d{1,4}(\.\d{1,4})?")
_MAX_CUDA_VERSION = 99_990  # CUDA 99.9
# Boards that have MIG by default: A100 and A30 (8.0), H100 and H200 (9.0), Blackwell
# data-centre parts (10.x). Other Ampere and Ada boards (8.6, 8.9: A6000, L40, L4) do not.
_MIG_CAPABILITIES = ((8, 0), (9, 0))
_FAULT_KINDS: tuple[FaultKind, ...] = get_args(FaultKind)
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
    problem = file_problem(path)
    if problem is None:
        return path
    text = os.fspath(source)
    if os.sep in text or text.endswith(".toml"):
        raise ScenarioError(f"scenario file {text} {_as_clause(problem)}")
    bundled = bundled_scenario_dir() / f"{text}.toml"
    if file_problem(bundled) is None:
        return bundled
    if problem != "does not exist":  # a directory of that name, a name too long, ...
        raise ScenarioError(f"scenario file {text} {_as_clause(problem)}")
    names = ", ".join(bundled_scenario_names())
    raise ScenarioError(
        f"unknown scenario {text!r}: not a file, and not a bundled scenario ({names})"
    )


def _as_clause(problem: str) -> str:
    """``file_problem``'s answer after the file's name: "does not exist", "is a
    directory", or "cannot be read: File name too long"."""
    return problem if problem.startswith(("does ", "is ")) else f"cannot be read: {problem}"


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


class _ScenarioReader:
    def __init__(self, path: Path, known_symbols: Callable[[str], bool]) -> None:
        self.path = path
        self.known_symbols = known_symbols

    def read(self, document: dict[str, Any], content_hash: str) -> Scenario:
        top = Table(document, "", self.path)
        fake = Table(top.get("fake", lambda v: v, {}), "fake", self.path)
        name = fake.get("name", values.string, self.path.stem)
        speed = fake.get("speed", values.number, 1.0)
        if not 0 < speed <= MAX_SPEED:
            raise fake.error("speed", f"must be > 0 and <= {MAX_SPEED:g}")
        lifetime = fake.get("lifetime", parse_seconds, DEFAULT_LIFETIME_SECONDS)
        if not 0 < lifetime <= MAX_LIFETIME_SECONDS:
            raise fake.error("lifetime", "must be longer than 0s and at most 7d")
        driver = fake.get("driver_version", values.string, "550.54.15")
        if not _DRIVER_VERSION.fullmatch(driver):
            raise fake.error("driver_version", f'expected e.g. "550.54.15", got {driver!r}')
        cuda = fake.get("cuda_driver_version", values.index, 12040)
        if not 1000 <= cuda <= _MAX_CUDA_VERSION:
            raise fake.error(
                "cuda_driver_version", f"expected MAJOR * 1000 + MINOR * 10 (12040), got {cuda}"
            )
        # Processes and faults are checked against the GPUs, so they are added second.
        scenario = Scenario(
            name=name,
            description=fake.get("description", values.string, ""),
            source=self.path,
            content_hash=content_hash,
            speed=speed,
            lifetime=lifetime,
            driver_version=driver,
            nvml_version=fake.get("nvml_version", values.string, f"12.{driver}"),
            cuda_driver_version=cuda,
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
        return dataclasses.replace(scenario, processes=processes, faults=faults)

    def _gpu(self, table: Table, index: int, scenario_name: str) -> GpuSpec:
        total = table.require("memory_total", parse_bytes)
        if not 0 < total <= MAX_BYTES:
            # What a snapshot can carry (gpuwatch.snapshot); bigger would fail there, late.
            raise table.error("memory_total", "must be more than 0 and at most 1 PiB")
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
        instance_ids = [m.gpu_instance_id for m in mig]
        repeated = sorted({i for i in instance_ids if instance_ids.count(i) > 1})
        if repeated:
            # NVML gives each GPU instance its own id; processes and metrics key on it.
            raise table.error("mig", f"gpu_instance_id {repeated[0]} is used more than once")
        capability = table.get("cuda_capability", values.string, "9.0")
        major, _, minor = capability.partition(".")
        if not (major.isdigit() and minor.isdigit()):
            raise table.error("cuda_capability", f'expected "MAJOR.MINOR", got {capability!r}')
        mig_capable = self._mig_capable(table, (int(major), int(minor)), has_mig=bool(mig))
        spec = GpuSpec(
            index=index,
            name=table.get("name", values.string, "NVIDIA H100 80GB HBM3"),
            uuid=table.get("uuid", values.string, values.derived_id("GPU", scenario_name, index)),
            pci_bus_id=table.get("pci_bus_id", values.pci_bus_id, f"00000000:{index + 1:02X}:00.0"),
            pci_device_id=table.get("pci_device_id", values.index, 0x233010DE),
            memory_total=total,
            memory_reserved=reserved,
            unattributed=table.get("unattributed", values.bytes_timeline, Constant(0)),
            power_limit_watts=table.get("power_limit_watts", values.number, 700.0),
            power_watts=table.get("power_watts", values.ranged_timeline(0, 100_000), None),
            temperature_celsius=table.get(
                "temperature_celsius", values.ranged_timeline(-100, 300), None
            ),
            utilization_percent=table.get("utilization_percent", values.PERCENT, None),
            memory_busy_percent=table.get("memory_busy_percent", values.PERCENT, None),
            fan_percent=table.get("fan_percent", values.PERCENT, Constant(30)),
            clock_sm_mhz=table.get("clock_sm_mhz", values.index, 1980),
            clock_memory_mhz=table.get("clock_memory_mhz", values.index, 2619),
            bar1_total=table.get("bar1_total", parse_bytes, 128 * 2**30),
            cuda_capability=(int(major), int(minor)),
            coherent=table.get("coherent", values.boolean, False),
            persistence_mode=table.get("persistence_mode", values.boolean, True),
            display_active=table.get("display_active", values.boolean, False),
            mig=mig,
            mig_capable=mig_capable,
            health=read_health(table),
            # Real GPM needs Hopper (compute capability 9.0) or later.
            gpm=table.get("gpm", values.boolean, int(major) >= 9),
        )
        table.done()
        return spec

    def _mig_capable(self, table: Table, capability: tuple[int, int], *, has_mig: bool) -> bool:
        """Whether the board has MIG (``mig_capable``; default by compute capability).
        Before Ampere no board has it, and only a board that has it can be in MIG mode."""
        default = capability in _MIG_CAPABILITIES or capability[0] == 10
        capable = table.get("mig_capable", values.boolean, default)
        if capable and capability < (8, 0):
            raise table.error("mig_capable", "no board before Ampere (cuda_capability 8.0) has MIG")
        if has_mig and not capable:
            raise table.error(
                "mig",
                "this board has no MIG (cuda_capability 8.0, 9.0 and 10.x do; or set mig_capable = true)",
            )
        return capable

    def _mig(self, table: Table, index: int, gpu: int, scenario_name: str) -> MigSpec:
        spec = MigSpec(
            index=index,
            profile=table.require("profile", values.string),
            uuid=table.get(
                "uuid", values.string, values.derived_id("MIG", scenario_name, gpu, index)
            ),
            memory_total=table.require("memory_total", parse_bytes),
            gpu_instance_id=table.get("gpu_instance_id", values.index, index + 1),
            compute_instance_id=table.get("compute_instance_id", values.index, 0),
            activity_percent=table.get("activity_percent", values.PERCENT, None),
        )
        table.done()
        return spec

    def _processes(self, tables: list[Table], scenario: Scenario) -> tuple[ProcessSpec, ...]:
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

    def _process(self, table: Table, entry: int, scenario: Scenario) -> list[ProcessSpec]:
        gpu = table.require("gpu", values.index)
        if gpu >= len(scenario.gpus):
            raise table.error("gpu", f"no GPU {gpu} (the scenario has {len(scenario.gpus)})")
        mig = table.get("mig", values.index, None)
        if mig is not None and mig >= len(scenario.gpus[gpu].mig):
            raise table.error("mig", f"GPU {gpu} has no MIG instance {mig}")
        count = table.get("count", values.index, 1)
        if not 1 <= count <= MAX_PROCESSES_PER_GPU:
            raise table.error("count", f"must be 1..{MAX_PROCESSES_PER_GPU}")
        origins = self._origins(table, count)
        kind = table.get("kind", values.string, "compute")
        if kind not in _PROCESS_KINDS:
            raise table.error("kind", f"must be one of {', '.join(_PROCESS_KINDS)}, got {kind!r}")
        start = table.get("start", parse_seconds, 0.0)
        exit_at = table.get("exit", parse_seconds, None)
        if exit_at is not None and exit_at <= start:
            raise table.error("exit", "must be later than start")
        memory = table.get("memory", values.bytes_timeline, Constant(0))
        if memory.bounds()[1] > scenario.gpus[gpu].memory_total:
            raise table.error("memory", "is larger than the GPU's memory_total")
        sm_percent = table.get("sm_percent", values.PERCENT, Constant(0))
        memory_busy = table.get("memory_busy_percent", values.PERCENT, None)
        tensor = table.get("tensor_percent", values.PERCENT, Constant(0))
        encoder = table.get("encoder_percent", values.PERCENT, Constant(0))
        decoder = table.get("decoder_percent", values.PERCENT, Constant(0))
        not_available = table.get("memory_not_available", values.boolean, False)
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
                tensor_percent=tensor,
                encoder_percent=encoder,
                decoder_percent=decoder,
                start=start,
                exit=exit_at,
                memory_not_available=not_available,
            )
            for copy, origin in enumerate(origins)
        ]

    def _origins(self, table: Table, count: int) -> list[Spawn | Attach | Ghost]:
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
            argv = table.require("spawn", values.argv)
            env = table.get("env", values.environment, ())
            orphan = table.get("orphan", values.boolean, False)
            return [Spawn(argv, env, orphan) for _ in range(count)]
        if given[0] == "ghost":
            pid = table.require("ghost", values.pid)
            if pid + count - 1 > values.MAX_PID:
                raise table.error("count", f"ghost PIDs would pass {values.MAX_PID}")
            return [Ghost(pid + copy) for copy in range(count)]
        target = table.require("attach", values.attach_target)
        if count != 1:
            raise table.error("count", "an attached PID cannot repeat; use ghost = PID for copies")
        return [Attach(target)]

    def _fault(self, table: Table, scenario: Scenario) -> FaultSpec:
        gpu = table.get("gpu", values.index, None)
        if gpu is not None and gpu >= len(scenario.gpus):
            raise table.error("gpu", f"no GPU {gpu} (the scenario has {len(scenario.gpus)})")
        kind = table.require("kind", values.string)
        if kind not in _FAULT_KINDS:
            raise table.error("kind", f"must be one of {', '.join(_FAULT_KINDS)}, got {kind!r}")
        functions = table.get("function", values.symbols, ())
        if kind == "gpu_lost":
            if functions:
                raise table.error(
                    "function", "gpu_lost applies to every call on the GPU; drop function"
                )
            if gpu is None:
                raise table.error("gpu", "gpu_lost needs the index of the GPU that is lost")
        elif kind in INIT_FAULT_KINDS:
            for key in ("function", "gpu", "mig"):
                if table.has(key):
                    raise table.error(key, f"{kind} fails nvmlInit, before any GPU; drop {key}")
            functions = INIT_FUNCTIONS
        elif not functions:
            raise table.error("function", f'{kind} needs function = "nvmlDevice..." (or a list)')
        for name in functions:
            if not self.known_symbols(name):
                raise table.error("function", f"the fake library has no NVML function {name!r}")
        seconds = table.get("seconds", values.number, 0.0)
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
            mig=self._fault_mig(table, kind, gpu, scenario),
        )
        table.done()
        return spec

    def _fault_mig(self, table: Table, kind: str, gpu: int | None, scenario: Scenario) -> MigScope:
        """Which of the GPU's handles a fault hits: ``mig = "parent"`` or ``mig = N``."""
        if not table.has("mig"):
            return None
        if kind == "gpu_lost":
            raise table.error("mig", "gpu_lost takes the whole GPU and its instances; drop mig")
        if gpu is None:
            raise table.error("mig", "needs gpu = N, the GPU whose handles it names")
        instances = len(scenario.gpus[gpu].mig)
        if instances == 0:
            raise table.error("mig", f"GPU {gpu} is not in MIG mode (it has no [[gpu.mig]])")
        scope = table.get("mig", values.mig_scope, None)
        if isinstance(scope, int) and scope >= instances:
            raise table.error("mig", f"GPU {gpu} has no MIG instance {scope}")
        return scope
