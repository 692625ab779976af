"""The running agent with its automatic policy on, polled by the test on the fake clock.

Shared by the policy tests (``test_auto*.py``): the agent's event sink that keeps what
it is given, an agent built on a :class:`~reaper.rig.Rig`'s sampler with ``[agent.reap]``
enabled, and a poll loop that lets stops in progress finish.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from reaper.rig import Rig
from support.agent_sink import RecordingSink as Events

from gpuwatch.agent.service import Agent
from gpuwatch.agent.state import AgentState
from gpuwatch.agent.torch_reports import TorchReports
from gpuwatch.settings import AgentSettings, load

MINUTE = 60.0


def policy_agent(
    rig: Rig, tmp_path: Path, sink: Events, *, agent: dict[str, Any] | None = None, **reap: Any
) -> Agent:
    """An agent polling every 30 s with the policy on (idle 30m, warn 10m, check 1m);
    ``reap`` overrides ``[agent.reap]`` keys, ``agent`` other ``[agent]`` keys."""
    settings = load(
        AgentSettings,
        listen="127.0.0.1:0",
        poll_interval_seconds=30.0,
        spool_dir=tmp_path / "spool",
        reap={
            "enabled": True,
            "idle": "30m",
            "warn_before": "10m",
            "check_interval": "1m",
            "contended_ratio": 0.5,
            "grace": "5s",
            "audit_log": str(tmp_path / "audit.jsonl"),
            **reap,
        },
        **(agent or {}),
    )
    return Agent(
        settings,
        sampler=rig.sampler(),
        state=AgentState(),
        torch_reports=TorchReports(),
        sink=sink,
        clock=rig.clock,
    )


def run_polls(
    agent: Agent, rig: Rig, minutes: float, *, until: Callable[[], bool] = lambda: False
) -> None:
    """Poll every 30 s of fake time for ``minutes``, letting stops in progress finish."""
    end = rig.clock.now + minutes * MINUTE
    while rig.clock.now < end and not until():
        agent.poll_once()
        auto = agent.reaper.auto
        assert auto is not None
        deadline = time.monotonic() + 30
        while auto.busy and time.monotonic() < deadline:
            time.sleep(0.05)  # the worker waits for the next poll: give it one
            agent.poll_once()
        rig.clock.advance(30)
