"""Boot a scenario's stand-ins once per host, find them again, and stop them.

:func:`ensure_running` is what every process calls (under the state file's lock): the
first one boots the scenario (a supervisor plus its stand-ins, see
:mod:`gpuwatch.nvml.fake.supervisor`); the rest read the same state file and so see the
same epoch and PIDs. A state is current while it belongs to this boot of the machine,
this scenario content, and its ``lifetime`` has not run out. Stand-ins that die are not
restarted, just as a killed process does not come back on a real GPU.

Stand-ins run as the booting user; a root booter may pass ``run_as`` (a uid and gid) to
start them as an unprivileged user instead (``gpuwatch demo`` does, because gpuwatch
never reaps root's processes). The state file stays the booter's.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from gpuwatch.errors import GpuwatchError
from gpuwatch.nvml.fake.procfs import ProcessIdentity, boot_id, identify, terminate
from gpuwatch.nvml.fake.runtime_state import (
    RuntimeState,
    locked,
    read_state,
    remove_lock,
    remove_state,
    state_path,
    write_state,
)
from gpuwatch.nvml.fake.scenario import Attach, Ghost, Scenario, Spawn

log = logging.getLogger(__name__)

# Starting a few dozen Python stand-ins on a loaded 2-core machine takes seconds.
BOOT_TIMEOUT_SECONDS = 60.0


def _is_current(state: RuntimeState, scenario: Scenario, now: float) -> bool:
    return (
        state.boot_id == boot_id()
        and state.content_hash == scenario.content_hash
        and now < state.deadline
    )


def ensure_running(
    scenario: Scenario,
    runtime_dir: Path,
    *,
    now: float | None = None,
    run_as: tuple[int, int] | None = None,
) -> RuntimeState:
    """The current state of ``scenario`` on this host, booting it first if needed.

    ``run_as`` ``(uid, gid)``: a boot starts the stand-ins as that user (needs root);
    joining a running scenario ignores it. Raises GpuwatchError when the stand-ins
    cannot be started.
    """
    path = state_path(runtime_dir, scenario.name, scenario.content_hash)
    with locked(path):
        wall = time.time()
        state = read_state(path)
        if state is not None and _is_current(state, scenario, wall):
            return state
        if state is not None:
            log.info("fake GPUs: scenario %s state is stale, booting it again", scenario.name)
            _terminate_state(state)
            remove_state(path)
        return _boot(scenario, path, wall, run_as)


def stop(scenario: Scenario, runtime_dir: Path) -> list[int]:
    """Kill the scenario's supervisor and stand-ins and remove its state; returns the PIDs
    signalled (empty when it was not running). Attached and ghost PIDs are never signalled.
    """
    return _stop_path(state_path(runtime_dir, scenario.name, scenario.content_hash))


def stop_all(runtime_dir: Path) -> list[int]:
    """Stop every scenario recorded in ``runtime_dir`` (whatever its scenario file now says)."""
    killed: list[int] = []
    # A lock without its state is an older version's leftover: removed the same way.
    stems = {p.with_suffix(".json") for p in runtime_dir.glob("*.lock")}
    for path in sorted(stems | set(runtime_dir.glob("*.json"))):
        killed += _stop_path(path)
    return killed


def _stop_path(path: Path) -> list[int]:
    with locked(path):
        state = read_state(path)
        remove_state(path)
        # Nothing of a stopped scenario stays behind, its lock file included.
        remove_lock(path)
        return [] if state is None else _terminate_state(state)


def _terminate_state(state: RuntimeState) -> list[int]:
    # Stand-ins first: the supervisor, once signalled, also kills them, and we want to
    # have signalled (and so report) each one ourselves before that race can start.
    return terminate([*state.standin_identities(), state.supervisor])


def _attach_pid(target: int | str) -> int:
    if target == "self":
        return os.getpid()
    if target == "parent":
        return os.getppid()
    return int(target)


@dataclass
class _BootPlan:
    """What the supervisor gets on stdin (as JSON): everything to start and record."""

    scenario: str
    content_hash: str
    boot_id: str
    epoch: float
    deadline: float
    state_path: str
    standins: list[dict[str, Any]] = field(default_factory=list)
    attached: dict[str, ProcessIdentity] = field(default_factory=dict)

    def to_json(self) -> str:
        document = asdict(self)
        document["attached"] = {k: [v.pid, v.start_ticks] for k, v in self.attached.items()}
        return json.dumps(document)


def _boot_plan(
    scenario: Scenario, path: Path, epoch: float, run_as: tuple[int, int] | None = None
) -> _BootPlan:
    plan = _BootPlan(
        scenario.name, scenario.content_hash, boot_id(), epoch, epoch + scenario.lifetime, str(path)
    )
    for process in scenario.processes:
        origin = process.origin
        if isinstance(origin, Spawn):
            exits = plan.deadline if process.exit is None else epoch + process.exit / scenario.speed
            plan.standins.append(
                {
                    "key": process.key,
                    "argv": list(origin.argv),
                    "env": [list(pair) for pair in origin.env],
                    "orphan": origin.orphan,
                    "deadline": min(plan.deadline, exits),
                    "run_as": None if run_as is None else list(run_as),
                }
            )
        elif isinstance(origin, Attach):
            identity = identify(_attach_pid(origin.target))
            if identity.start_ticks is None:
                log.warning(
                    "fake GPUs: attach = %s: PID %s is not running", origin.target, identity.pid
                )
            plan.attached[process.key] = identity
        elif isinstance(origin, Ghost) and identify(origin.pid).start_ticks is not None:
            log.warning(
                "fake GPUs: ghost PID %s exists on this host; it is listed anyway", origin.pid
            )
    return plan


def _supervisor_environment() -> dict[str, str]:
    """The booting process's environment, with gpuwatch importable by the supervisor.

    Read from os.environ (not settings) on purpose: this is the child's inherited
    environment, not configuration. gpuwatch's root is appended to PYTHONPATH because a
    program under `gpuwatch fake-nvml exec` may have found gpuwatch only through the
    injection's fallback path.
    """
    import gpuwatch

    root = str(Path(gpuwatch.__file__).resolve().parent.parent)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), root) if p)
    return env


def _boot(
    scenario: Scenario, path: Path, epoch: float, run_as: tuple[int, int] | None
) -> RuntimeState:
    plan = _boot_plan(scenario, path, epoch, run_as)
    if not plan.standins:
        # Nothing to spawn or reap: record the state here, without a supervisor.
        recorded = RuntimeState(
            plan.scenario,
            plan.content_hash,
            plan.boot_id,
            epoch,
            plan.deadline,
            ProcessIdentity(0, None),
            plan.attached,
        )
        write_state(path, recorded)
        return recorded
    log.info("fake GPUs: booting scenario %s (%d stand-ins)", scenario.name, len(plan.standins))
    try:
        supervisor = subprocess.run(
            [sys.executable, "-m", "gpuwatch.nvml.fake.supervisor", scenario.name],
            input=plan.to_json().encode(),
            capture_output=True,
            env=_supervisor_environment(),
            cwd="/",
            timeout=BOOT_TIMEOUT_SECONDS,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        raise GpuwatchError(f"fake GPUs: cannot start scenario {scenario.name}: {err}") from err
    lines = supervisor.stdout.decode(errors="replace").splitlines()
    report = json.loads(lines[0]) if lines and lines[0].startswith("{") else {}
    if not report.get("ok"):
        stderr = supervisor.stderr.decode(errors="replace").strip().splitlines()
        reason = report.get("error") or (stderr[-1] if stderr else "no output")
        raise GpuwatchError(f"fake GPUs: scenario {scenario.name} failed to start: {reason}")
    state = read_state(path)
    if state is None:
        raise GpuwatchError(
            f"fake GPUs: scenario {scenario.name} started but wrote no state to {path}"
        )
    return state
