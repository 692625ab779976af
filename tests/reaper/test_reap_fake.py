"""The whole reaper in one process: real processes, fake GPUs, history from polls.

The fake clock drives hours of polling in milliseconds; the processes, their signals
and their exits are real, and NVML (the fake beneath pynvml) stops listing a process
and frees its memory when it really dies.
"""

from __future__ import annotations

from pathlib import Path

from reaper.helpers import HOUR, Signals, drive, executor, history, plan_over
from reaper.rig import ALICE, GiB, Hold, Rig

from gpuwatch.wire import ReportedEvent


def _used(rig: Rig, index: int) -> int | None:
    gpu = rig.sampler().poll().gpu(index)
    assert gpu is not None
    return gpu.memory_used_bytes


def test_idle_process_is_chosen_and_stopped_and_its_memory_freed(
    rig, clock, victims, tmp_path: Path
) -> None:
    idle, busy = victims(), victims()
    rig.install(
        [Hold(idle.pid, gpu=0, memory="8GiB"), Hold(busy.pid, gpu=1, memory="6GiB", sm="60")]
    )
    sampler = rig.sampler()
    hist = history()
    snapshot = drive(sampler, hist, clock, 2 * HOUR)
    plan = plan_over(snapshot, hist, clock())
    verdicts = {d.candidate.pid: (d.verdict, d.reason) for d in plan.decisions}
    assert verdicts == {idle.pid: ("reap", "idle"), busy.pid: ("spare", "active")}
    assert _used(rig, 0) == 8 * GiB

    signals, events = Signals(), list[ReportedEvent]()
    results = executor(sampler, tmp_path / "audit.jsonl", signals=signals, events=events).run(
        plan, dry_run=False
    )

    assert [(r.pid, r.outcome) for r in results] == [(idle.pid, "terminated")]
    assert signals.names == ["SIGTERM"]  # honoured: no SIGKILL
    assert idle.exit_signal() == 15
    assert results[0].memory_freed is True and results[0].memory_freed_bytes == 8 * GiB
    assert _used(rig, 0) == 0  # freed in the fake
    assert busy.alive()


def test_video_work_alone_is_activity(rig, clock, victims) -> None:
    # A transcoder keeps NVENC/NVDEC busy and the SMs at 0: it is working, not idle.
    encoding, decoding, idle = victims(), victims(), victims()
    rig.install(
        [
            Hold(encoding.pid, encoder="35"),
            Hold(decoding.pid, gpu=1, decoder='{ steps = [["0s", 20], ["90m", 0]] }'),
            Hold(idle.pid, gpu=1),
        ]
    )
    sampler = rig.sampler()
    hist = history()
    snapshot = drive(sampler, hist, clock, 2 * HOUR)
    verdicts = {
        d.candidate.pid: (d.verdict, d.reason) for d in plan_over(snapshot, hist, clock()).decisions
    }
    assert verdicts == {
        encoding.pid: ("spare", "active"),
        decoding.pid: ("spare", "idle_too_short"),  # decoded until minute 90
        idle.pid: ("reap", "idle"),
    }


def test_gaps_in_history_make_a_process_not_idle(rig, clock, victims) -> None:
    idle = victims()
    rig.install([Hold(idle.pid)])
    sampler = rig.sampler()
    hist = history()
    drive(sampler, hist, clock, 30 * 60)
    clock.advance(40 * 60)  # the agent was down for 40 minutes: unknown, not idle
    snapshot = drive(sampler, hist, clock, 2 * HOUR - 70 * 60)
    (decision,) = plan_over(snapshot, hist, clock()).decisions
    assert decision.verdict == "spare"
    assert decision.reason == "idle_too_short"  # the idle clock restarted after the gap

    # Short gaps are not bridged either: a burst there would be seen by nobody.
    hist = history()
    snapshot = sampler.poll()
    for _ in range(12):  # 12 x (4 min observed + 6 min missing) = 2 hours
        snapshot = drive(sampler, hist, clock, 4 * 60)
        clock.advance(6 * 60)
    snapshot = drive(sampler, hist, clock, 60)
    (decision,) = plan_over(snapshot, hist, clock()).decisions
    assert (decision.verdict, decision.reason) == ("spare", "idle_too_short")
    assert "nobody observed" in decision.detail


def test_without_history_nothing_is_idle(rig, clock, victims) -> None:
    idle = victims()
    rig.install([Hold(idle.pid)])
    snapshot = rig.sampler().poll()
    (decision,) = plan_over(snapshot, None, clock()).decisions
    assert (decision.verdict, decision.reason) == ("spare", "no_history")


def test_dry_run_chooses_the_same_and_sends_nothing(rig, clock, victims, tmp_path: Path) -> None:
    idle, other = victims(), victims(uid=ALICE + 1)
    rig.install([Hold(idle.pid), Hold(other.pid, gpu=1, sm='{ steps = [["0s", 50], ["45m", 0]] }')])
    sampler = rig.sampler()
    hist = history()
    snapshot = drive(sampler, hist, clock, 90 * 60)
    dry = plan_over(snapshot, hist, clock())
    real = plan_over(snapshot, hist, clock())
    assert [(d.candidate.pid, d.verdict, d.reason, d.detail) for d in dry.decisions] == [
        (d.candidate.pid, d.verdict, d.reason, d.detail) for d in real.decisions
    ]
    signals, events = Signals(), list[ReportedEvent]()
    run = executor(sampler, tmp_path / "audit.jsonl", signals=signals, events=events)
    results = run.run(dry, dry_run=True)
    assert [(r.pid, r.outcome) for r in results] == [(idle.pid, "dry_run")]
    assert signals.sent == []
    assert idle.alive() and other.alive()
    assert [e.evidence["stage"] for e in events] == ["dry_run"]
    rows = [(r["event"], r["pid"], r["dry_run"]) for r in run._audit.read()]  # type: ignore[attr-defined]
    assert sorted(rows) == sorted([("decision", idle.pid, True), ("decision", other.pid, True)])


def test_audit_rows_come_before_the_signal_and_the_event_says_what_was_freed(
    rig, clock, victims, tmp_path: Path
) -> None:
    idle = victims(stubborn=True)
    rig.install([Hold(idle.pid, memory="11GiB")])
    sampler = rig.sampler()
    hist = history()
    snapshot = drive(sampler, hist, clock, 2 * HOUR)
    plan = plan_over(snapshot, hist, clock())
    audit_path = tmp_path / "audit.jsonl"
    seen_at_signal: list[list[str]] = []

    class Watching(Signals):
        def __call__(self, fd: int, sig: int) -> None:
            from gpuwatch.agent.reaper.audit import AuditLog

            seen_at_signal.append([row["event"] for row in AuditLog(audit_path).read()])
            super().__call__(fd, sig)

    signals, events = Watching(), list[ReportedEvent]()
    (result,) = executor(sampler, audit_path, grace=0.5, signals=signals, events=events).run(
        plan, dry_run=False
    )
    assert result.outcome == "killed" and signals.names == ["SIGTERM", "SIGKILL"]
    # Each signal had its own row on disk before it was sent.
    assert seen_at_signal == [["decision", "signal"], ["decision", "signal", "signal"]]
    (event,) = events
    assert event.kind == "reaped" and event.pid == idle.pid and event.user == str(ALICE)
    assert event.held_bytes == 11 * GiB
    assert event.evidence["outcome"] == "killed"
    assert event.evidence["memory_freed_bytes"] == 11 * GiB
    assert event.evidence["actor"]["via"] == "test"
    assert "killed" in event.summary and "11.0 GiB freed" in event.summary
