"""The automatic policy after an agent restart: the central server's samples fill the window.

Everything real but the GPUs: a live ``gpuwatch`` server (uvicorn, SQLite) that took
hours of snapshots through its ingest API, real victim processes on fake GPUs, and the
agent's own poll loop on the fake clock, reading the server over HTTP. The agent
restarted a minute after its last push, so its own history is far shorter than the
2-hour window.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
from reaper.central_rig import READ_TOKEN, STEP, Central
from reaper.policy_rig import Events, policy_agent, run_polls
from reaper.rig import Hold, Rig, Victim

from gpuwatch.agent.reaper.server_cache import CachedServerHistory
from gpuwatch.agent.service import Agent

MINUTE = 60.0
HOUR = 3600.0


def _pushed_until_restart(
    rig: Rig,
    holds: list[Hold],
    central: Central,
    *,
    gap: tuple[float, float] | None = None,
) -> float:
    """Polls every 30 s for 2.5 hours, pushed to the server (but those ``gap`` = (from,
    to) minutes before the end); returns the restart time, a minute after the last."""
    end = time.time()
    start = end - 2.5 * HOUR
    rig.clock.now = start
    rig.install(holds)
    sampler = rig.sampler()
    snapshots = []
    while rig.clock.now < end:
        snapshot = sampler.poll()
        ago = (end - rig.clock.now) / MINUTE
        if gap is None or not gap[1] <= ago < gap[0]:
            snapshots.append(snapshot)
        rig.clock.advance(STEP)
    central.push(snapshots)
    rig.clock.now = end + MINUTE
    return rig.clock.now


def _restarted(
    rig: Rig,
    tmp_path: Path,
    sink: Events,
    server_url: str,
    token: str,
    *,
    read_token: str = READ_TOKEN,
    **reap: object,
) -> Agent:
    return policy_agent(
        rig,
        tmp_path,
        sink,
        agent={"server_url": server_url, "token": token},
        idle="2h",
        warn_before="0s",
        server_read_token=read_token,
        **reap,
    )


def _server(agent: Agent) -> CachedServerHistory:
    auto = agent.reaper.auto
    assert auto is not None and auto.server is not None
    return auto.server


def test_the_server_is_asked_once_per_refresh_and_never_bridges_the_restart(
    rig: Rig, victims: Callable[..., Victim], central: Central, tmp_path: Path
) -> None:
    idle = victims()
    _pushed_until_restart(rig, [Hold(idle.pid, memory="6GiB")], central)
    sink = Events()
    agent = _restarted(rig, tmp_path, sink, central.url, central.token, contended_ratio=0.9)

    # 25 checks on a GPU nobody needs: idle by the server's samples, but left alone.
    run_polls(agent, rig, 25)
    stats = _server(agent).stats
    assert sink.events == [] and idle.alive()
    assert 1 <= stats.asked <= 3  # once per 10-minute refresh, not once per check
    assert stats.cached >= 20 and stats.failures == 0

    agent.reaper.note_oom(0, 99999, rig.clock.now)  # now someone waits for GPU 0
    run_polls(agent, rig, 3, until=lambda: not idle.alive())
    # The restart is time nobody observed: the server's samples from before it cannot
    # make the process idle (docs/reaper.md, "Gaps"); the agent's own 28 minutes can't.
    assert sink.stages(idle.pid) == [] and idle.alive()


@pytest.mark.parametrize("failure", ["gap", "unreachable", "wrong_read_token"])
def test_a_gap_on_the_server_or_no_server_is_never_idle(
    rig: Rig, victims: Callable[..., Victim], central: Central, tmp_path: Path, failure: str
) -> None:
    idle = victims()
    # A gap of 20 minutes (longer than max_gap, 10m) an hour before the restart.
    gap = (80.0, 60.0) if failure == "gap" else None
    _pushed_until_restart(rig, [Hold(idle.pid, memory="11GiB")], central, gap=gap)
    url = "http://127.0.0.1:9" if failure == "unreachable" else central.url
    sink = Events()
    read_token = "wrong" if failure == "wrong_read_token" else READ_TOKEN
    agent = _restarted(rig, tmp_path, sink, url, central.token, read_token=read_token)

    run_polls(agent, rig, 20)

    assert sink.events == [] and idle.alive()
    stats = _server(agent).stats
    if failure == "gap":
        assert stats.failures == 0 and stats.asked >= 1
    else:
        # Backing off 1, 2, 4, 8 minutes...: a handful of tries in 20 checks.
        assert 1 <= stats.failures == stats.asked <= 5
