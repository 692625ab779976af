"""The policy's batch: contention is judged again before each stop of one check.

Two idle processes come due at the same check on a GPU 75% full; the first (largest)
stop frees it to 25%, and nobody is waiting any more: the second is spared, its
warning withdrawn as ``uncontended``, and the stop it was allowed under the rate caps
given back.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from reaper.policy_rig import Events, policy_agent, run_polls
from reaper.rig import ALICE, Hold, Rig, Victim

from gpuwatch.agent.reaper.audit import AuditLog


def test_a_batch_stops_no_more_once_the_gpu_is_no_longer_contended(
    rig: Rig, victims: Callable[..., Victim], tmp_path: Path
) -> None:
    big, small, busy = victims(), victims(uid=ALICE + 1), victims(uid=ALICE + 2)
    rig.install(
        [
            Hold(small.pid, memory="1GiB"),
            Hold(big.pid, memory="8GiB"),
            Hold(busy.pid, memory="3GiB", sm="50"),
        ]
    )  # 12 of 16 GiB: 75% full
    sink = Events()
    agent = policy_agent(rig, tmp_path, sink, contended_ratio=0.7)
    run_polls(agent, rig, 31)
    assert sink.stages(big.pid) == ["warning"] and sink.stages(small.pid) == ["warning"]

    run_polls(agent, rig, 12, until=lambda: not big.alive())  # both due at one check
    run_polls(agent, rig, 1)
    assert not big.alive() and small.alive() and busy.alive()
    assert sink.stages(big.pid) == ["warning", "stopped"]
    # "failed": the executor's word for a stop it did not carry out (no_longer_eligible).
    assert sink.stages(small.pid) == ["warning", "failed", "withdrawn"]
    rows = [r for r in AuditLog(tmp_path / "audit.jsonl").read() if r.get("pid") == small.pid]
    assert "signal" not in [r["event"] for r in rows]
    (withdrawn,) = [r for r in rows if r["event"] == "withdrawn"]
    assert withdrawn["withdrawn_because"] == "its GPU is no longer contended"
    auto = agent.reaper.auto
    assert auto is not None
    counts = auto.stats.snapshot()
    assert counts.withdrawn.get("uncontended") == 1
    assert counts.stops.get("terminated") == 1 and counts.stops.get("no_longer_eligible") == 1
    assert len(auto._stops) == 1  # the spared process does not count against the caps

    # Still uncontended afterwards: never warned again, never signalled.
    run_polls(agent, rig, 45)
    assert small.alive() and sink.stages(small.pid) == ["warning", "failed", "withdrawn"]


def test_the_policy_turns_itself_off_where_a_pidfd_may_name_another_process(
    rig: Rig, victims: Callable[..., Victim], tmp_path: Path, monkeypatch, caplog
) -> None:
    # H1: an agent in a nested PID namespace reading the host's /proc (what
    # test_nested_pid_namespace.py does for real): no warning, no signal, said once.
    from gpuwatch.agent.reaper import killer

    monkeypatch.setattr(killer, "namespace_problem", lambda root: "nested PID namespace here")
    idle = victims()
    rig.install([Hold(idle.pid, memory="12GiB")])
    sink = Events()
    agent = policy_agent(rig, tmp_path, sink)
    run_polls(agent, rig, 60)
    assert idle.alive() and sink.events == []
    auto = agent.reaper.auto
    assert auto is not None
    assert auto.stats.snapshot().refusals.get("policy_disabled") == 1
    assert "reaper policy disabled: nested PID namespace here" in caplog.text
