"""The reaper never acts on a lost or unreadable GPU, nor on stale history.

Real parts: the agent's own history (``ProcessHistory``) fed poll by poll, and the
plan every reap runs (``make_plan``: candidates, idle evidence, the pure policy).
Each case is paired with its control, the same process on a healthy GPU with fresh
history, which *is* chosen: so a "spared" below is the fault's doing, not a setup
that could never reap anything.
"""

from __future__ import annotations

import pytest

from gpuwatch.agent.reaper.history import ProcessHistory
from gpuwatch.agent.reaper.plan import IdleRule, Plan, make_plan
from gpuwatch.agent.reaper.policy import Protections, Selection
from gpuwatch.snapshot import Gpu, GpuProcess, HostSnapshot, ProcessOwner

GiB = 2**30
T0 = 1_800_000_000.0
POLL = 15.0
WINDOW = 1800.0  # reap what has been idle for 30 minutes
MAX_GAP = 120.0
RULE = IdleRule(
    window_seconds=WINDOW, min_memory_bytes=GiB, max_gap_seconds=MAX_GAP, min_coverage=0.9
)
IDLER, SPANNER = 4242, 5151  # on GPU 1; on GPUs 0 and 1


def process(pid: int) -> GpuProcess:
    return GpuProcess(
        pid=pid,
        used_bytes=10 * GiB,
        sm_ratio=0.0,
        name="python",
        command=f"python notebook.py {pid}",
        start_time=T0 - 86_400 + pid,
        owner=ProcessOwner(user="alice", uid=1000),
    )


def healthy(index: int, pids: list[int]) -> Gpu:
    return Gpu(
        index=index,
        uuid=f"GPU-{index}",
        name="NVIDIA A100-SXM4-80GB",
        memory_total_bytes=80 * GiB,
        memory_used_bytes=10 * GiB * len(pids),
        utilization_ratio=0.0,
        processes=[process(p) for p in pids],
    )


def host(t: float, gpu1: Gpu | None = None) -> HostSnapshot:
    """GPU 0 holds SPANNER; GPU 1 holds IDLER and SPANNER, unless ``gpu1`` replaces it."""
    return HostSnapshot(
        agent_id="agent-1",
        hostname="host-1",
        boot_id="boot-1",
        sequence=int(t),
        collected_at=t,
        gpus=[healthy(0, [SPANNER]), gpu1 or healthy(1, [IDLER, SPANNER])],
    )


def idle_for(seconds: float, *, until: float) -> ProcessHistory:
    """The agent's history after ``seconds`` of polls, every one of them idle."""
    history = ProcessHistory(
        poll_interval_seconds=POLL, history_seconds=86_400, max_gap_seconds=MAX_GAP, max_runs=64
    )
    t = until - seconds
    while t <= until:
        history.observe(host(t))
        t += POLL
    return history


def plan(snapshot: HostSnapshot, history: ProcessHistory, now: float) -> Plan:
    return make_plan(
        snapshot,
        history.runs_for,
        now=now,
        rule=RULE,
        selection=Selection(window_seconds=WINDOW, min_memory_bytes=GiB),
        protections=Protections(),
        caller_uid=None,
    )


def verdicts(p: Plan) -> dict[int, tuple[str, str]]:
    return {d.candidate.pid: (d.verdict, d.reason) for d in p.decisions}


def test_control_idle_processes_on_healthy_gpus_with_fresh_history_are_chosen() -> None:
    now = T0 + 7200
    history = idle_for(7200, until=now)
    assert verdicts(plan(host(now), history, now)) == {
        IDLER: ("reap", "idle"),
        SPANNER: ("reap", "idle"),
    }


@pytest.mark.parametrize(
    "bad",
    [
        Gpu(index=1, uuid="GPU-1", name="NVIDIA A100-SXM4-80GB", lost=True),
        Gpu(index=1, uuid="GPU-unknown-1", read_error="timeout"),
    ],
    ids=["lost", "timed-out"],
)
def test_nothing_on_a_lost_or_unreadable_gpu_is_chosen(bad: Gpu) -> None:
    now = T0 + 7200
    history = idle_for(7200, until=now - POLL)  # idle until the poll before the fault
    history.observe(host(now, gpu1=bad))

    decided = plan(host(now, gpu1=bad), history, now)

    assert IDLER not in verdicts(decided)  # nothing known of GPU 1's processes now
    assert not [h for d in decided.chosen for h in d.candidate.holdings if h.gpu_index == 1]


def test_a_process_that_also_holds_a_lost_gpu_is_spared() -> None:
    now = T0 + 7200
    lost = Gpu(index=1, uuid="GPU-1", name="NVIDIA A100-SXM4-80GB", lost=True)
    history = idle_for(7200, until=now - POLL)
    history.observe(host(now, gpu1=lost))

    # Its GPU 0 history alone says idle (the control test chooses it); GPU 1's is unknown.
    assert verdicts(plan(host(now, gpu1=lost), history, now))[SPANNER] == ("spare", "unknown")


@pytest.mark.parametrize("silent_for", [MAX_GAP + POLL, 3600.0, 86_400.0])
def test_stale_history_is_never_acted_on(silent_for: float) -> None:
    # Two hours idle, then the agent saw nothing more (its polls failed, or it was
    # stopped): now a snapshot shows the same processes, still idle. The history ends
    # ``silent_for`` ago; one fresh sample is never enough.
    last = T0 + 7200
    history = idle_for(7200, until=last)
    now = last + silent_for

    decided = verdicts(plan(host(now), history, now))

    assert decided[IDLER][0] == "spare" and decided[SPANNER][0] == "spare"
    assert decided[IDLER][1] in {"unknown", "no_history", "idle_too_short", "coverage"}


def test_history_resumed_after_a_gap_must_cover_a_whole_window_again() -> None:
    # The agent comes back after a long silence and polls again: idle since, but for
    # less than the window, so not yet; a whole window later, yes.
    last = T0 + 7200
    history = idle_for(7200, until=last)
    resumed = last + 3600
    t = resumed
    while t <= resumed + WINDOW / 2:
        history.observe(host(t))
        t += POLL
    assert verdicts(plan(host(t - POLL), history, t - POLL))[IDLER][0] == "spare"
    while t <= resumed + WINDOW + POLL:
        history.observe(host(t))
        t += POLL
    assert verdicts(plan(host(t - POLL), history, t - POLL))[IDLER] == ("reap", "idle")
