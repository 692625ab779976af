"""``gpuwatch reap`` after an agent restart: the central server's samples never bridge it.

Everything real but the GPUs: a live ``gpuwatch`` server (uvicorn, SQLite) that read
hours of snapshots through its ingest API, real victim processes on fake GPUs, and
the command line as a child process. The agent (a stand-in serving a history recorded
over the same fake GPUs) restarted 10 minutes ago, so its own history is too short
for a 2-hour window; the server's decides the rest, or, when it cannot be trusted
or reached, nothing is idle.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from reaper.central_rig import READ_TOKEN, STEP, Central
from reaper.rig import HistoryServer, Hold, Rig, Victim, _boot_id, run_cli, write_config

from gpuwatch.agent.reaper.history import ProcessHistory
from gpuwatch.agent.reaper.served import history_report
from gpuwatch.snapshot import HostSnapshot

MINUTE = 60.0
HOUR = 3600.0


def _record(
    rig: Rig,
    holds: list[Hold],
    central: Central,
    agent: HistoryServer,
    *,
    server_gap: tuple[float, float] | None = None,
    pushed: Callable[[HostSnapshot], HostSnapshot] = lambda s: s,
    restart_seconds: float = MINUTE,
) -> Path:
    """2.5 hours of polls ending now: all pushed to the server (but ``restart_seconds``
    before the restart, when nobody polled, and ``server_gap``, minutes ago), only the
    last 10 minutes in the agent's history. Returns the scenario file for the command's
    own NVML view."""
    now = time.time()
    start, restart = now - 2.5 * HOUR, now - 10 * MINUTE
    rig.clock.now = start
    scenario = rig.install(holds)
    sampler = rig.sampler()
    history = ProcessHistory(
        poll_interval_seconds=STEP, history_seconds=86400, max_gap_seconds=600, max_runs=32
    )
    snapshots = []
    for i in range(int((now - start) // STEP) + 1):
        rig.clock.now = start + i * STEP
        snapshot = sampler.poll()
        ago = now - rig.clock.now
        if rig.clock.now >= restart:
            history.observe(snapshot)  # the restarted agent
        elif rig.clock.now >= restart - restart_seconds:
            continue  # the agent was restarting: nobody polled
        if server_gap is None or not server_gap[1] <= ago < server_gap[0]:
            snapshots.append(pushed(snapshot))
    central.push(snapshots)
    report = history_report(
        history, hostname=socket.gethostname(), boot_id=_boot_id(), generated_at=time.time()
    )
    agent.body = report.model_dump_json().encode()
    return scenario


def _reap(
    tmp_path: Path,
    agent: HistoryServer,
    scenario: Path,
    *,
    server_url: str,
    token: str,
    read_token: str = READ_TOKEN,
) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    config = write_config(
        tmp_path / "gpuwatch.toml",
        f"""
        [agent]
        server_url = "{server_url}"
        token = "{token}"
        """,
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUWATCH_")}
    env |= {
        "XDG_RUNTIME_DIR": str(tmp_path / "cli-runtime"),
        "GPUWATCH_CONFIG": str(config),
        "GPUWATCH_SERVER_READ_TOKEN": read_token,
        "HOME": str(tmp_path),
    }
    done = run_cli(
        "reap",
        "--idle",
        "2h",
        "--yes",
        "--json",
        "--grace",
        "5s",
        "--agent",
        agent.url,
        "--fake-gpus",
        str(scenario),
        "--audit-log",
        str(tmp_path / "audit.jsonl"),
        env=env,
    )
    assert done.returncode in (0, 20), done.stderr
    return done, json.loads(done.stdout)


def _only(out: dict[str, Any]) -> dict[str, Any]:
    (candidate,) = out["candidates"]
    return candidate  # type: ignore[no-any-return]


def test_a_restart_that_nobody_observed_restarts_the_window_and_says_so(
    rig: Rig, victims: Callable[..., Victim], central: Central, agent: HistoryServer, tmp_path: Path
) -> None:
    # The agent restarted: time nobody can show was observed, even where the server's
    # buckets run on across it (a restart between two polls, restart_seconds=0) or a
    # minute with no poll at all: a burst there would be seen by nobody, so the idle
    # stretch starts after it (audit finding 5), and the verdict says why.
    idle = victims()
    scenario = _record(rig, [Hold(idle.pid, memory="11GiB")], central, agent, restart_seconds=0)

    done, out = _reap(tmp_path, agent, scenario, server_url=central.url, token=central.token)

    candidate = _only(out)
    assert (candidate["decision"], candidate["reason"]) == ("spare", "idle_too_short"), candidate
    assert "nobody observed" in candidate["detail"] and "agent restart" in candidate["detail"]
    assert candidate["idle_seconds"] < 11 * MINUTE
    assert done.returncode == 20 and idle.alive()


def test_a_gap_in_the_servers_samples_is_not_idle(
    rig: Rig, victims: Callable[..., Victim], central: Central, agent: HistoryServer, tmp_path: Path
) -> None:
    idle = victims()
    # Nothing reached the server from 80 to 60 minutes ago: a gap, whatever its length.
    gap = (80 * MINUTE, 60 * MINUTE)
    scenario = _record(rig, [Hold(idle.pid)], central, agent, server_gap=gap, restart_seconds=0)

    done, out = _reap(tmp_path, agent, scenario, server_url=central.url, token=central.token)

    candidate = _only(out)
    assert (candidate["decision"], candidate["reason"]) == ("spare", "idle_too_short")
    assert candidate["idle_seconds"] < 11 * MINUTE
    assert done.returncode == 20 and idle.alive()


def test_a_reused_pid_inherits_no_history(
    rig: Rig, victims: Callable[..., Victim], central: Central, agent: HistoryServer, tmp_path: Path
) -> None:
    newcomer = victims()

    def earlier_process(snapshot: HostSnapshot) -> HostSnapshot:
        # What the server saw was another process that had this PID: it started earlier.
        data = snapshot.model_dump(mode="json")
        for gpu in data["gpus"]:
            for process in gpu["processes"]:
                if process["pid"] == newcomer.pid:
                    process["start_time"] -= 1000
        return HostSnapshot.model_validate(data)

    scenario = _record(rig, [Hold(newcomer.pid)], central, agent, pushed=earlier_process)

    done, out = _reap(tmp_path, agent, scenario, server_url=central.url, token=central.token)

    candidate = _only(out)
    assert (candidate["decision"], candidate["reason"]) == ("spare", "idle_too_short")
    assert "server" not in candidate["detail"]
    assert not any("central server" in n for n in out["notes"])
    assert done.returncode == 20 and newcomer.alive()


@pytest.mark.parametrize("failure", ["unreachable", "wrong_read_token"])
def test_without_the_server_the_agents_short_history_alone_decides(
    rig: Rig,
    victims: Callable[..., Victim],
    central: Central,
    agent: HistoryServer,
    tmp_path: Path,
    failure: str,
) -> None:
    idle = victims()
    scenario = _record(rig, [Hold(idle.pid)], central, agent)
    url = "http://127.0.0.1:9" if failure == "unreachable" else central.url

    done, out = _reap(
        tmp_path, agent, scenario, server_url=url, token=central.token, read_token="wrong"
    )

    candidate = _only(out)
    assert (candidate["decision"], candidate["reason"]) == ("spare", "idle_too_short")
    (note,) = [n for n in out["notes"] if "central server" in n]
    assert "history is not used" in note and "the agent's history alone decides" in note
    assert ("refused the read token" in note) == (failure == "wrong_read_token")
    assert done.returncode == 20 and idle.alive()
