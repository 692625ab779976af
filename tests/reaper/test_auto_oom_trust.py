"""The policy counts an OOM report as contention only when it proves someone waits.

Any local user can POST an incident to the agent. Real processes on fake GPUs, the real
agent and its HTTP endpoint; reports are posted by other uids (``setpriv``), so the
agent reads each poster's uid from the kernel, as in production.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from reaper.policy_rig import Events, policy_agent, run_polls
from reaper.rig import ALICE, BOB, Hold, Rig, Victim

from gpuwatch.agent.service import Agent
from gpuwatch.wire import INCIDENTS_OOM_PATH

FUTURE = 8_000_000_000.0  # year 2223: "contended for the agent's whole life"

_POST = (
    "import sys, httpx; "
    "r = httpx.post(sys.argv[1], content=sys.argv[2], "
    "headers={'content-type': 'application/json'}); print(r.status_code)"
)


def post_as(uid: int, agent: Agent, body: dict[str, Any]) -> None:
    """POST an incident from a process running as ``uid`` (curl's part in the report)."""
    command = [sys.executable, "-c", _POST, agent.exporter.url + INCIDENTS_OOM_PATH]
    command = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--", *command]
    done = subprocess.run(
        [*command, json.dumps(body)], capture_output=True, text=True, timeout=60, cwd="/"
    )
    assert done.stdout.strip() == "202", done.stderr  # taken (and forwarded) either way


@pytest.fixture
def serving() -> Iterator[list[Agent]]:
    started: list[Agent] = []
    yield started
    for agent in started:
        agent.exporter.stop()


def _agent(rig: Rig, tmp_path: Path, sink: Events, serving: list[Agent], **reap: Any) -> Agent:
    agent = policy_agent(rig, tmp_path, sink, **reap)
    agent.exporter.start()
    serving.append(agent)
    return agent


def test_forged_oom_reports_never_make_a_gpu_contended(
    rig: Rig,
    victims: Callable[..., Victim],
    tmp_path: Path,
    serving: list[Agent],
    caplog: pytest.LogCaptureFixture,
) -> None:
    idle = victims(uid=ALICE)  # 2 of 16 GiB, idle: the process a forger wants stopped
    alices_job = victims(uid=ALICE)
    bobs_elsewhere = victims(uid=BOB)  # bob's, alive, on no GPU
    rig.install([Hold(idle.pid, memory="2GiB"), Hold(alices_job.pid, memory="1GiB", sm="50")])
    sink = Events()
    agent = _agent(rig, tmp_path, sink, serving)
    run_polls(agent, rig, 31)  # idle long enough: only contention is missing
    assert sink.events == []

    oom = {"message": "CUDA out of memory", "occurred_at": FUTURE}
    with caplog.at_level(logging.INFO, logger="gpuwatch.agent.service"):
        post_as(BOB, agent, {**oom, "pid": 1, "device_index": 0})  # the audit's report
        post_as(BOB, agent, {**oom, "pid": alices_job.pid, "device_index": 0})  # not his
        post_as(BOB, agent, {**oom, "pid": bobs_elsewhere.pid, "device_index": 0})  # no context
        post_as(ALICE, agent, {**oom, "pid": alices_job.pid, "device_index": 5})  # no such GPU
        post_as(ALICE, agent, {**oom, "pid": alices_job.pid, "device_uuid": "GPU-elsewhere"})
        post_as(0, agent, {**oom, "pid": 4_000_000, "device_index": 0})  # root, no such PID
        run_polls(agent, rig, 15)

    assert idle.alive() and sink.stages(idle.pid) == []
    # Each is still information: forwarded as reported, time included.
    forwarded = [e for e in sink.events if e.kind == "oom"]
    assert len(forwarded) == 6 and {e.occurred_at for e in forwarded} == {FUTURE}
    why = [r.getMessage() for r in caplog.records if "not counted as contention" in r.getMessage()]
    assert len(why) == 6
    assert "pid 1 holds no context on gpu0" in why[0]
    assert f"uid {BOB}) is neither root nor pid {alices_job.pid}'s owner (uid {ALICE})" in why[1]
    assert f"pid {bobs_elsewhere.pid} holds no context on gpu0" in why[2]
    assert "gpu5 is not in the agent's latest poll" in why[3]
    assert "names no GPU this agent sees" in why[4]
    assert "holds no context" in why[5]
    auto = agent.reaper.auto
    assert auto is not None and auto._ooms == {}


def test_a_genuine_oom_counts_from_when_the_agent_received_it(
    rig: Rig, victims: Callable[..., Victim], tmp_path: Path, serving: list[Agent]
) -> None:
    idle = victims(uid=ALICE)
    bobs_job = victims(uid=BOB)  # training on the same GPU; it runs out of memory
    rig.install([Hold(idle.pid, memory="2GiB"), Hold(bobs_job.pid, memory="1GiB", sm="50")])
    sink = Events()
    # Warned 10m before a stop, but an OOM makes the GPU contended for 5m only.
    agent = _agent(rig, tmp_path, sink, serving, oom_wait="5m")
    run_polls(agent, rig, 31)
    gpu0 = agent.state.latest.gpus[0].uuid  # type: ignore[union-attr]

    # Its owner reports it, naming the GPU by UUID as torch prints it; a clock far ahead.
    body = {"pid": bobs_job.pid, "device_uuid": gpu0.removeprefix("GPU-"), "occurred_at": FUTURE}
    post_as(BOB, agent, {**body, "message": "CUDA out of memory"})
    run_polls(agent, rig, 2)
    assert sink.stages(idle.pid) == ["warning"]
    warning = next(e for e in sink.events if e.pid == idle.pid)
    assert "another process ran out of memory on gpu0" in warning.summary

    # Five minutes after the agent received it, nobody is waiting any more: the body's
    # time (year 2223) must not keep the GPU contended until the stop.
    run_polls(agent, rig, 12, until=lambda: not idle.alive())
    assert idle.alive()
    assert sink.stages(idle.pid) == ["warning", "withdrawn"]


def test_root_may_report_for_any_process(
    rig: Rig, victims: Callable[..., Victim], tmp_path: Path, serving: list[Agent]
) -> None:
    idle, bobs_job = victims(uid=ALICE), victims(uid=BOB)
    rig.install([Hold(idle.pid, memory="2GiB"), Hold(bobs_job.pid, memory="1GiB", sm="50")])
    sink = Events()
    agent = _agent(rig, tmp_path, sink, serving)
    run_polls(agent, rig, 31)
    post_as(0, agent, {"pid": bobs_job.pid, "device_index": 0, "message": "CUDA out of memory"})
    run_polls(agent, rig, 2)
    assert sink.stages(idle.pid) == ["warning"]


def test_oom_entries_are_pruned_at_every_check(
    rig: Rig, victims: Callable[..., Victim], tmp_path: Path, serving: list[Agent]
) -> None:
    rig.install([])  # two GPUs, nobody on them: no candidate reads any entry
    agent = _agent(rig, tmp_path, Events(), serving, oom_wait="5m")
    auto = agent.reaper.auto
    assert auto is not None
    auto.note_oom(0, 4242, rig.clock.now)
    auto.note_oom(0, 4242, rig.clock.now)  # one entry per process and GPU
    auto.note_oom(1, 4343, FUTURE)  # never later than the policy's clock
    auto.note_oom(7, 4444, rig.clock.now)  # a GPU this host does not have
    noted_at = rig.clock.now
    run_polls(agent, rig, 1)
    # Keyed by (GPU, MIG instance): whole GPUs here.
    assert auto._ooms == {(0, None): {4242: noted_at}, (1, None): {4343: noted_at}}  # gpu7: dropped
    run_polls(agent, rig, 6)
    assert auto._ooms == {}
