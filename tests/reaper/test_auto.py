"""The agent's automatic policy, through the agent's own poll loop on a fake clock.

Real processes on fake GPUs; the agent polls when the test says (``poll_once``) and
its clock moves only when the test advances it, so an hour of policy runs in seconds.
Stops run on the policy's worker thread, which waits for the agent's next poll to
confirm and to verify, as in production.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families
from reaper.policy_rig import Events, policy_agent, run_polls
from reaper.rig import ALICE, Hold, Rig, Victim

from gpuwatch.agent.collectors import reaper as reaper_metrics
from gpuwatch.agent.collectors.reaper import ReaperCollector
from gpuwatch.agent.reaper.audit import AuditLog
from gpuwatch.agent.reaper.stats import (
    REFUSAL_REASONS,
    STOP_OUTCOMES,
    WITHDRAWN_REASONS,
    PolicyCounts,
)
from gpuwatch.agent.service import Agent


def test_warned_then_spared_on_activity_then_stopped_while_still_idle(
    rig: Rig, victims: Callable[..., Victim], tmp_path: Path
) -> None:
    steady, wakes = victims(), victims(uid=ALICE + 1)
    # `wakes` runs a kernel from minute 35 to 36: during its warning.
    active = '{ steps = [["0s", 0], ["35m", 50], ["36m", 0]] }'
    rig.install([Hold(steady.pid, memory="6GiB"), Hold(wakes.pid, memory="6GiB", sm=active)])
    sink = Events()
    agent = policy_agent(rig, tmp_path, sink, contended_ratio=0.3)  # 6 of 16 GiB is enough
    run_polls(agent, rig, 31)
    assert sink.stages(steady.pid) == ["warning"] and sink.stages(wakes.pid) == ["warning"]
    warning = next(e for e in sink.events if e.pid == steady.pid)
    assert "will be stopped in 10m unless it becomes active" in warning.summary
    assert (
        f"pid {steady.pid} ({ALICE}, " in warning.summary and "6.0 GiB on gpu0" in warning.summary
    )

    run_polls(agent, rig, 6)  # minute 37: `wakes` was active, its warning is withdrawn
    assert sink.stages(wakes.pid) == ["warning", "withdrawn"]
    assert steady.alive() and wakes.alive()

    run_polls(agent, rig, 5, until=lambda: not steady.alive())  # minute 42: past the deadline
    assert sink.stages(steady.pid) == ["warning", "stopped"]
    assert steady.exit_signal() == 15
    stopped = [e for e in sink.events if e.pid == steady.pid][-1]
    assert stopped.evidence["outcome"] == "terminated" and stopped.evidence["memory_freed"] is True
    assert wakes.alive()

    # Still idle after its burst: warned again 30 minutes later, then stopped.
    run_polls(agent, rig, 45, until=lambda: not wakes.alive())
    assert sink.stages(wakes.pid) == ["warning", "withdrawn", "warning", "stopped"]
    rows = [(r["event"], r.get("pid")) for r in AuditLog(tmp_path / "audit.jsonl").read()]
    assert rows[0] == ("policy_started", None)
    assert ("withdrawn", wakes.pid) in rows
    assert rows.index(("signal", steady.pid)) < rows.index(("outcome", steady.pid))


def test_never_acts_on_an_uncontended_gpu(
    rig: Rig, victims: Callable[..., Victim], tmp_path: Path
) -> None:
    idle = victims()
    rig.install([Hold(idle.pid, memory="2GiB")])  # 2 of 16 GiB: nobody needs it
    sink = Events()
    agent = policy_agent(rig, tmp_path, sink)
    run_polls(agent, rig, 90)
    assert sink.events == [] and idle.alive()
    assert [r["event"] for r in AuditLog(tmp_path / "audit.jsonl").read()] == ["policy_started"]

    # Someone else runs out of memory on that GPU: now it is contended.
    # (The agent hands the policy each OOM incident that proves it, Agent._on_oom:
    # test_auto_oom_trust.py drives that part over HTTP.)
    agent.reaper.note_oom(0, 99999, rig.clock.now)
    sink.events.clear()
    run_polls(agent, rig, 12, until=lambda: not idle.alive())
    assert sink.stages(idle.pid) == ["warning", "stopped"]


def test_a_warning_on_a_gpu_that_is_lost_is_withdrawn_as_unreadable_not_gone(
    rig: Rig, victims: Callable[..., Victim], tmp_path: Path
) -> None:
    from reaper.rig import scenario_text

    idle = victims()
    fault = '\n[[fault]]\ngpu = 0\nkind = "gpu_lost"\nat = "33m"\n'
    rig.install_text(scenario_text([Hold(idle.pid, memory="12GiB")]) + fault)
    sink = Events()
    agent = policy_agent(rig, tmp_path, sink)
    run_polls(agent, rig, 50)
    assert idle.alive()  # never signalled on a GPU that cannot be read
    assert sink.stages(idle.pid) == ["warning", "withdrawn"]
    (row,) = [r for r in AuditLog(tmp_path / "audit.jsonl").read() if r["event"] == "withdrawn"]
    assert row["withdrawn_because"] == "gpu0 cannot be read now (lost, or an NVML error)"
    auto = agent.reaper.auto
    assert auto is not None
    assert auto.stats.snapshot().withdrawn == {"gpu_unreadable": 1}


def test_rate_caps_and_dry_run(rig: Rig, victims: Callable[..., Victim], tmp_path: Path) -> None:
    a, b, c = victims(), victims(), victims()
    rig.install([Hold(v.pid, memory="5GiB") for v in (a, b, c)])
    sink = Events()
    agent = policy_agent(rig, tmp_path, sink, max_per_user_per_hour=1, warn_before="0s")
    run_polls(agent, rig, 33)
    stopped = [v for v in (a, b, c) if not v.alive()]
    assert len(stopped) == 1  # one of alice's per hour
    assert sum(s == "stopped" for v in (a, b, c) for s in sink.stages(v.pid)) == 1

    dry_sink = Events()
    dry = policy_agent(rig, tmp_path / "dry", dry_sink, dry_run=True, warn_before="0s")
    run_polls(dry, rig, 33)
    survivors = [v for v in (a, b, c) if v.alive()]
    assert len(survivors) == 2
    assert sorted(s for v in survivors for s in dry_sink.stages(v.pid)) == ["dry_run", "dry_run"]


def test_no_policy_without_a_writable_audit_log(rig: Rig, tmp_path: Path) -> None:
    rig.install([])
    blocked = tmp_path / "not-a-dir"
    blocked.write_text("")  # a file where the log's directory should be
    agent = policy_agent(rig, tmp_path, Events(), audit_log=str(blocked / "audit.jsonl"))
    assert agent.reaper.auto is None  # disabled at start, with the reason logged


# --- /metrics: what the policy did, as the agent exports it ------------------------------

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def _scrape(agent: Agent) -> tuple[str, Samples]:
    response = httpx.get(f"{agent.exporter.url}/metrics")
    assert response.status_code == 200
    samples = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
    }
    return response.text, samples


def _by(samples: Samples, name: str, label: str) -> dict[str, float]:
    return {dict(labels)[label]: v for (n, labels), v in samples.items() if n == name}


def _policy(samples: Samples) -> dict[str, object]:
    return {
        "warnings": samples[("gpuwatch_reaper_warnings_total", ())],
        "warned": samples[("gpuwatch_reaper_warned_processes", ())],
        "withdrawn": _by(samples, "gpuwatch_reaper_warnings_withdrawn_total", "reason"),
        "stops": _by(samples, "gpuwatch_reaper_stops_total", "outcome"),
        "refusals": _by(samples, "gpuwatch_reaper_refusals_total", "reason"),
    }


def _zero(values: tuple[str, ...], **counted: float) -> dict[str, float]:
    return {**dict.fromkeys(values, 0.0), **counted}


def test_metrics_count_warnings_withdrawals_and_stops_from_zero(
    rig: Rig, victims: Callable[..., Victim], tmp_path: Path
) -> None:
    steady, wakes = victims(), victims(uid=ALICE + 1)
    active = '{ steps = [["0s", 0], ["35m", 50], ["36m", 0]] }'
    rig.install([Hold(steady.pid, memory="6GiB"), Hold(wakes.pid, memory="6GiB", sm=active)])
    agent = policy_agent(rig, tmp_path, Events(), contended_ratio=0.3)
    agent.exporter.start()
    try:
        text, first = _scrape(agent)
        assert _policy(first) == {
            "warnings": 0,
            "warned": 0,
            "withdrawn": _zero(WITHDRAWN_REASONS),
            "stops": _zero(STOP_OUTCOMES),
            "refusals": _zero(REFUSAL_REASONS),
        }
        if shutil.which("promtool"):
            lint = subprocess.run(
                ["promtool", "check", "metrics"], input=text.encode(), capture_output=True
            )
            assert lint.returncode == 0 and not lint.stderr.strip(), lint.stderr.decode()

        run_polls(agent, rig, 31)  # both warned
        warned = _policy(_scrape(agent)[1])
        assert (warned["warnings"], warned["warned"]) == (2, 2)

        run_polls(agent, rig, 6)  # `wakes` ran a kernel: its warning is withdrawn
        spared = _policy(_scrape(agent)[1])
        assert spared["withdrawn"] == _zero(WITHDRAWN_REASONS, not_idle=1)
        assert spared["warned"] == 1

        run_polls(agent, rig, 5, until=lambda: not steady.alive())  # `steady` is stopped
        assert steady.exit_signal() == 15
        done = _policy(_scrape(agent)[1])
        assert done["stops"] == _zero(STOP_OUTCOMES, terminated=1)
        assert (done["warnings"], done["warned"]) == (2, 0)
        assert done["refusals"] == _zero(REFUSAL_REASONS)
    finally:
        agent.exporter.stop()


def test_metrics_count_capped_stops_as_refusals(
    rig: Rig, victims: Callable[..., Victim], tmp_path: Path
) -> None:
    a, b = victims(), victims()
    rig.install([Hold(v.pid, memory="5GiB") for v in (a, b)])
    agent = policy_agent(rig, tmp_path, Events(), max_per_user_per_hour=1, warn_before="0s")
    agent.exporter.start()
    try:
        run_polls(agent, rig, 33)
        counts = _policy(_scrape(agent)[1])
    finally:
        agent.exporter.stop()
    assert counts["stops"] == _zero(STOP_OUTCOMES, terminated=1)
    refusals = counts["refusals"]
    assert isinstance(refusals, dict) and refusals["user_cap"] >= 1
    # No warning step (warn_before 0): nobody was warned, so nobody is "under warning".
    assert (counts["warnings"], counts["warned"]) == (0, 0)


def test_metrics_show_a_policy_that_could_not_start_and_none_when_off(
    rig: Rig, tmp_path: Path
) -> None:
    rig.install([])
    blocked = tmp_path / "not-a-dir"
    blocked.write_text("")
    broken = policy_agent(rig, tmp_path, Events(), audit_log=str(blocked / "audit.jsonl"))
    off = policy_agent(rig, tmp_path / "off", Events(), enabled=False)
    for agent in (broken, off):
        agent.exporter.start()
    try:
        refusals = _policy(_scrape(broken)[1])["refusals"]
        _, off_samples = _scrape(off)
    finally:
        for agent in (broken, off):
            agent.exporter.stop()
    assert refusals == _zero(REFUSAL_REASONS, policy_disabled=1)
    assert not [name for name, _ in off_samples if name.startswith("gpuwatch_reaper_")]
    assert off_samples[("gpuwatch_scrape_collector_success", (("collector", "reaper"),))] == 1


def test_the_reaper_collector_yields_exactly_its_declared_families() -> None:
    collector = ReaperCollector(lambda: PolicyCounts())
    declared = {spec.name for spec in reaper_metrics.METRICS}
    assert {family.name for family in collector.collect()} == declared
    assert list(ReaperCollector(lambda: None).collect()) == []


def test_a_dry_run_warning_says_it_is_a_dry_run(
    rig: Rig, victims: Callable[..., Victim], tmp_path: Path
) -> None:
    # Audit finding 8: in test mode owners were told "will be stopped in 10m" with no
    # sign that nothing would be.
    idle = victims()
    rig.install([Hold(idle.pid, memory="6GiB")])
    sink = Events()
    agent = policy_agent(rig, tmp_path, sink, contended_ratio=0.3, dry_run=True)
    run_polls(agent, rig, 31)
    (warning,) = [e for e in sink.events if e.pid == idle.pid]
    assert warning.evidence["stage"] == "warning" and warning.evidence["dry_run"] is True
    assert warning.summary.startswith("dry run, nothing will be stopped: ")
    assert idle.alive()
