"""The automatic policy on MIG GPUs: a process is judged by its GPU instance's activity.

Real processes attached to MIG instances of fake GPUs, the agent's own poll loop on a
fake clock. On the H100 the agent reads each instance's activity through GPM between
polls; on the A100 there is no GPM, so its processes' activity is unknown and they are
never idle.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from reaper.policy_rig import Events, policy_agent, run_polls
from reaper.rig import ALICE, BOB, Rig, Victim

from gpuwatch.agent.reaper.plan import IdleRule, make_plan
from gpuwatch.agent.reaper.policy import Protections, Selection

MINUTE = 60.0


def _scenario(busy: int, idle: int, no_gpm: int) -> str:
    return f"""
[fake]
name = "reap-mig"
lifetime = "10m"

[[gpu]]
name = "NVIDIA H100 80GB HBM3"
memory_total = "16GiB"
reserved = "0MiB"
[[gpu.mig]]
profile = "2g.8gb"
memory_total = "8GiB"
gpu_instance_id = 3
[[gpu.mig]]
profile = "2g.8gb"
memory_total = "8GiB"
gpu_instance_id = 5

[[gpu]]
name = "NVIDIA A100-SXM4-80GB"
memory_total = "16GiB"
reserved = "0MiB"
cuda_capability = "8.0"
[[gpu.mig]]
profile = "3g.8gb"
memory_total = "8GiB"

[[process]]
gpu = 0
mig = 0
attach = {busy}
memory = "6GiB"
sm_percent = 40

[[process]]
gpu = 0
mig = 1
attach = {idle}
memory = "6GiB"

[[process]]
gpu = 1
mig = 0
attach = {no_gpm}
memory = "6GiB"
"""


def test_idle_instance_is_reaped_busy_instance_spared_and_no_gpm_is_unknown(
    rig: Rig, victims: Callable[..., Victim], tmp_path: Path
) -> None:
    busy, idle, no_gpm = victims(), victims(uid=BOB), victims(uid=ALICE + 1)
    rig.install_text(_scenario(busy.pid, idle.pid, no_gpm.pid))
    sink = Events()
    agent = policy_agent(rig, tmp_path, sink, contended_ratio=0.3, warn_before="0s")

    run_polls(agent, rig, 33, until=lambda: not idle.alive())

    assert sink.stages(idle.pid) == ["stopped"]
    assert idle.exit_signal() == 15
    assert busy.alive() and no_gpm.alive()
    assert sink.stages(busy.pid) == [] and sink.stages(no_gpm.pid) == []

    # Why the others are spared, as `gpuwatch reap` would say from the same history.
    snapshot = rig.sampler().poll()  # on the same NVML session as the agent
    plan = make_plan(
        snapshot,
        agent.reaper.history.runs_for,
        now=rig.clock.now,
        rule=IdleRule(30 * MINUTE, 256 * 2**20, 600.0, 0.9),
        selection=Selection(window_seconds=30 * MINUTE, min_memory_bytes=256 * 2**20),
        protections=Protections(),
        caller_uid=None,
    )
    spared = {d.candidate.pid: (d.verdict, d.reason, d.detail) for d in plan.decisions}
    assert spared[busy.pid][:2] == ("spare", "active")
    assert spared[no_gpm.pid][:2] == ("spare", "unknown")
    assert "no GPM" in spared[no_gpm.pid][2]
