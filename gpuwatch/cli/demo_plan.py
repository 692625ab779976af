"""What ``gpuwatch demo`` runs, and with which settings: hosts, timings, files.

Everything here is computed, and written into the run's own directory, before anything
starts. The demo's settings come from the demo alone: no config file and no
``GPUWATCH_*`` variable reaches its server or its agents, so a demo never pushes to a
real server or notifies a real Slack channel.

**Timings.** Real defaults watch for an hour (idle) or half an hour (leaks). The demo
shortens every window so each problem shows while you watch, and ``--speed S`` divides
all of them by S while the scenarios' own clocks run S times faster (the leak grows S
GiB a minute), except that the agent polls every second at any speed and pushes at most
every second, and a bucket is at least 2 s (:data:`FLOORS`). At ``--speed 1``:

- agent poll / push: 1 s / 2 s (the defaults: 5 s / 15 s);
- server bucket, ``sample_interval_seconds``: 5 s (60 s);
- idle window, ``idle_window_seconds``: 30 s (1 h);
- leak window, ``leak_min_duration_seconds``: 60 s (30 min), so the longest period
  ruled out as a leak is 60 s, not 30 min;
- filling horizon, ``filling_horizon_seconds``: 2 h (2 h);
- ``for`` and ``held_for`` of the shipped alert rules: 10 s (1 to 60 min);
  ``gpu_nearly_full``: 30 s; ``keep_firing_for``: 60 s;
- ``group_wait`` 5 s (30 s), ``group_interval`` 30 s (5 min), ``evaluation_interval``
  2 s (15 s), ``repeat_interval`` 1 h (4 h);
- ``--idle`` of the printed ``gpuwatch reap``: 60 s.
"""

from __future__ import annotations

import json
import math
import os
import pwd
import secrets
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from gpuwatch.nvml.fake.scenario_file import bundled_scenario_dir
from gpuwatch.settings import ServerSettings
from gpuwatch.wire import MAX_PUSH_INTERVAL_SECONDS

MAX_SPEED = 4.0
# What --speed does not shorten further. The fake GPUs keep one per-process utilisation
# sample per wall second (as NVML keeps a few): an agent polling faster reads a busy
# process as idle between samples. A bucket holds at least two pushes (docs/detection.md).
FLOORS = {"poll": 1.0, "push": 1.0, "bucket": 2.0}
SINK_RECEIVER = "demo-sink"


@dataclass(frozen=True)
class DemoHost:
    """One simulated host: the hostname its agent reports and the bundled scenario."""

    hostname: str
    scenario: str
    shows: str


HOSTS = (
    DemoHost("gpu-a", "demo-a", "a leak filling a GPU (runaway, filling up, alert)"),
    DemoHost("gpu-b", "demo-b", "a forgotten notebook beside a busy run (idle, reap)"),
    DemoHost("gpu-c", "demo-c", "an orphaned script, a dead PID, unclaimed memory"),
)
# The host whose idle notebook the printed `gpuwatch reap` command stops.
REAP_HOST = "gpu-b"


@dataclass(frozen=True)
class Timings:
    """Every duration the demo sets, in wall-clock seconds (see the module docstring)."""

    speed: float
    poll: float = 1.0
    push: float = 2.0
    bucket: float = 5.0
    idle_window: float = 30.0
    leak_window: float = 60.0
    filling_horizon: float = 7200.0
    alert_for: float = 10.0
    keep_firing: float = 60.0
    nearly_full_for: float = 30.0
    evaluation: float = 2.0
    group_wait: float = 5.0
    group_interval: float = 30.0
    repeat: float = 3600.0
    reap_idle: float = 60.0

    @classmethod
    def at(cls, speed: float) -> Timings:
        """The speed-1 values divided by ``speed``, none below its floor (:data:`FLOORS`).

        Raises ValueError for a speed out of [:data:`MIN_SPEED`, :data:`MAX_SPEED`].
        """
        if not MIN_SPEED <= speed <= MAX_SPEED:  # nan too
            raise ValueError(f"--speed must be at least {MIN_SPEED:g} and at most {MAX_SPEED:g}")
        base = cls(speed=1.0)
        scaled = {
            f.name: max(getattr(base, f.name) / speed, FLOORS.get(f.name, 0.0))
            for f in fields(cls)
            if f.name != "speed"
        }
        return cls(speed=speed, **scaled)

    def described(self) -> dict[str, float]:
        return {f.name: round(getattr(self, f.name), 3) for f in fields(self)}


# The slowest --speed: below it the push interval (2 s at speed 1) would pass the longest
# the agent and the server take (MAX_PUSH_INTERVAL_SECONDS, 1 h), and the demo would
# stop on its own settings. Every other window's bound is wider (a test builds them all
# at this speed). Rounded up, so the push interval stays within the bound.
MIN_SPEED = math.ceil(Timings.push / MAX_PUSH_INTERVAL_SECONDS * 1e6) / 1e6


def server_settings(
    t: Timings, *, listen: str, data_dir: Path, sink_url: str, sink_secret: str, dashboard: str
) -> ServerSettings:
    """SQLite under ``data_dir``, short windows, and one signed webhook: the demo's sink.

    From the demo alone: built directly, not by ``load``, so no config file and no
    environment variable changes it."""
    quick = {"for": t.alert_for, "keep_firing_for": t.keep_firing}
    held = {"held_for": t.alert_for, "keep_firing_for": t.keep_firing}
    values: dict[str, Any] = {
        "listen": listen,
        "data_dir": data_dir,
        "agent_push_interval_seconds": t.push,
        "sample_interval_seconds": t.bucket,
        "idle_window_seconds": t.idle_window,
        "leak_min_duration_seconds": t.leak_window,
        "filling_horizon_seconds": t.filling_horizon,
        "receivers": [
            {"name": SINK_RECEIVER, "type": "webhook", "url": sink_url, "secret": sink_secret}
        ],
        "alerts": {
            "evaluation_interval": t.evaluation,
            "group_wait": t.group_wait,
            "group_interval": t.group_interval,
            "repeat_interval": t.repeat,
            "external_url": dashboard,
            "rules": {
                "gpu_filling_up_warning": quick,
                "gpu_filling_up_critical": quick,
                "gpu_nearly_full": {"for": t.nearly_full_for, "keep_firing_for": t.keep_firing},
                "runaway_process": quick,
                "orphaned_memory": held,
                "idle_holder": held,
                "agent_silent": {"for": t.alert_for},
            },
        },
    }
    return ServerSettings(**values)


def new_run_id() -> str:
    return secrets.token_hex(4)


def write_scenario_copy(
    host: DemoHost, directory: Path, *, run_id: str, speed: float, lifetime: float
) -> Path:
    """This run's copy of the host's bundled scenario, with ``speed`` and ``lifetime``.

    The run id in its first line makes the copy's content, and so its content hash,
    this run's own: its runtime state file and stand-ins are this run's alone, and
    stopping them never touches another run's (or a plain ``fake-nvml start``'s).
    """
    source = (bundled_scenario_dir() / f"{host.scenario}.toml").read_text(encoding="utf-8")
    header = f"# gpuwatch demo run {run_id}: a copy of {host.scenario}.toml\n"
    settings = f'[fake]\nspeed = {speed!r}\nlifetime = "{int(lifetime)}s"\n'
    if source.count("[fake]\n") != 1:
        raise ValueError(f"{host.scenario}.toml: expected one [fake] table")
    path = directory / f"{host.scenario}.toml"
    path.write_text(header + source.replace("[fake]\n", settings), encoding="utf-8")
    return path


def _toml(value: Any) -> str:
    # JSON strings, numbers and booleans are valid TOML values (paths, tokens, URLs).
    return json.dumps(str(value) if isinstance(value, Path) else value)


def write_agent_config(path: Path, agent: dict[str, Any], reap: dict[str, Any]) -> Path:
    """An ``[agent]`` config file, mode 0600 (it holds the host's token)."""
    lines = ["[agent]", *(f"{k} = {_toml(v)}" for k, v in agent.items()), "", "[agent.reap]"]
    lines += [f"{k} = {_toml(v)}" for k, v in reap.items()]
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as file:
        file.write("\n".join(lines) + "\n")
    return path


def standin_user() -> tuple[int, int] | None:
    """Who the stand-ins run as: ``nobody`` when the demo runs as root, else None (you).

    gpuwatch never reaps root's processes, so root's stand-ins could not show the
    reaper; their owners' names still come from the scenarios (docs/scenarios.md).
    """
    if os.geteuid() != 0:
        return None
    try:
        entry = pwd.getpwnam("nobody")
    except KeyError:
        return (65534, 65534)
    return (entry.pw_uid, entry.pw_gid)
