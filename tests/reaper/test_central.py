"""The central server's buckets as idle evidence: conversion, combination, matching.

The buckets are the server's own response model (what ``HistoryClient`` returns); the
verdict is the reaper's :func:`~gpuwatch.agent.reaper.evidence.idle_evidence` over
the combined runs, as the planner computes it.
"""

from __future__ import annotations

from gpuwatch.agent.reaper.central import (
    JUNCTION_GAP_SECONDS,
    bucket_runs,
    combine,
    matches,
    server_may_help,
)
from gpuwatch.agent.reaper.evidence import idle_evidence
from gpuwatch.agent.reaper.history import Run
from gpuwatch.server.processes.schemas import ProcessOut, ProcessSampleOut

GiB = 2**30
NOW = 1_800_000_000.0
MINUTE = 60.0
HOUR = 3600.0


def _buckets(
    start: float, end: float, sm: float | None = 0.0, *, skip: tuple[float, float] | None = None
) -> list[ProcessSampleOut]:
    """One-minute buckets from ``start`` up to ``end`` (epoch s), none inside ``skip``."""
    out = []
    t = start
    while t < end:
        if skip is None or not skip[0] <= t < skip[1]:
            out.append(ProcessSampleOut(t=t, used_bytes=8 * GiB, peak_bytes=8 * GiB, sm_ratio=sm))
        t += MINUTE
    return out


def _runs(buckets: list[ProcessSampleOut], first: float, last: float) -> list[Run]:
    return bucket_runs(buckets, interval_seconds=MINUTE, first_seen_at=first, last_seen_at=last)


def _agent(since: float, activity: str = "idle", cpu_busy: bool = False) -> list[Run]:
    """The agent restarted at ``since`` and has seen one run since."""
    return [Run(since, NOW, activity, 8 * GiB, 8 * GiB, 0.0, cpu_busy)]  # type: ignore[arg-type]


def _verdict(runs: list[Run], window: float = 2 * HOUR) -> tuple[str, float | None]:
    evidence = idle_evidence(
        runs,
        now=NOW,
        window_seconds=window,
        min_bytes=256 * 2**20,
        max_gap_seconds=600.0,
        min_coverage=0.9,
    )
    return evidence.reason, evidence.idle_seconds


def test_consecutive_idle_buckets_are_one_run_cut_to_when_the_server_saw_it() -> None:
    first, last = NOW - 3 * HOUR + 20, NOW - 10 * MINUTE - 15
    runs = _runs(_buckets(NOW - 3 * HOUR, NOW - 10 * MINUTE), first, last)

    assert [(r.start, r.end, r.activity) for r in runs] == [(first, last, "idle")]
    assert runs[0].low_bytes == 8 * GiB


def test_a_missing_bucket_is_a_gap_and_activity_and_unknown_are_runs() -> None:
    buckets = (
        _buckets(NOW - 60 * MINUTE, NOW - 50 * MINUTE)
        + _buckets(NOW - 48 * MINUTE, NOW - 47 * MINUTE, sm=None)
        + _buckets(NOW - 47 * MINUTE, NOW - 46 * MINUTE, sm=0.4)
    )
    runs = _runs(buckets, NOW - HOUR, NOW)

    assert [(r.start, r.end, r.activity) for r in runs] == [
        (NOW - 60 * MINUTE, NOW - 50 * MINUTE, "idle"),
        (NOW - 48 * MINUTE, NOW - 47 * MINUTE, "unknown"),
        (NOW - 47 * MINUTE, NOW - 46 * MINUTE, "active"),
    ]
    assert runs[2].busiest_ratio == 0.4


def test_an_agent_restart_is_a_gap_the_servers_samples_do_not_bridge() -> None:
    restart = NOW - 10 * MINUTE
    # Even where the server's buckets reach the restart: nobody can show that no poll
    # was missed across it, so the idle stretch starts with the agent's own history.
    for server_until in (restart - MINUTE, restart, restart + MINUTE):
        server = _runs(_buckets(NOW - 3 * HOUR, server_until), NOW - 3 * HOUR, server_until)
        agent = _agent(restart)

        reason, idle_seconds = _verdict(combine(server, agent))
        assert reason == "idle_too_short" and idle_seconds == 10 * MINUTE


def test_a_long_gap_in_the_servers_samples_restarts_the_idle_clock() -> None:
    restart = NOW - 10 * MINUTE
    gap = (NOW - 90 * MINUTE, NOW - 70 * MINUTE)  # 20 minutes: longer than max_gap
    server = _runs(_buckets(NOW - 3 * HOUR, restart, skip=gap), NOW - 3 * HOUR, restart)

    reason, idle_seconds = _verdict(combine(server, _agent(restart)))

    # The restart, after the gap, is a gap too: the agent's own 10 minutes are all.
    assert reason == "idle_too_short" and idle_seconds == 10 * MINUTE


def test_short_gaps_restart_the_idle_clock_too() -> None:
    restart = NOW - 10 * MINUTE
    holes = [(NOW - m * MINUTE, NOW - (m - 5) * MINUTE) for m in (110, 90, 70)]  # 15 minutes
    buckets = [
        b
        for b in _buckets(NOW - 2 * HOUR - MINUTE, restart)
        if not any(lo <= b.t < hi for lo, hi in holes)
    ]
    server = _runs(buckets, NOW - 3 * HOUR, restart)

    reason, idle_seconds = _verdict(combine(server, _agent(restart)))
    assert reason == "idle_too_short" and idle_seconds == 10 * MINUTE


def test_unknown_activity_on_the_server_is_not_idle() -> None:
    restart = NOW - 10 * MINUTE
    buckets = _buckets(NOW - 3 * HOUR, NOW - HOUR) + _buckets(NOW - HOUR, restart, sm=None)
    server = _runs(buckets, NOW - 3 * HOUR, restart)

    assert _verdict(combine(server, _agent(restart)))[0] == "idle_too_short"


def test_the_agents_runs_win_where_both_have_samples() -> None:
    restart = NOW - 10 * MINUTE
    # The server's last bucket reaches past the restart, and one later bucket is busy.
    server = _runs(_buckets(NOW - 3 * HOUR, restart + 5 * MINUTE), NOW - 3 * HOUR, NOW)
    server += _runs(_buckets(restart + 5 * MINUTE, restart + 6 * MINUTE, sm=0.9), NOW - HOUR, NOW)

    combined = combine(server, _agent(restart))

    assert [(r.start, r.end, r.activity) for r in combined] == [
        (NOW - 3 * HOUR, restart - JUNCTION_GAP_SECONDS, "idle"),
        (restart, NOW, "idle"),
    ]


def test_the_server_is_asked_only_when_the_agent_saw_quiet_idleness_since_inside_the_window() -> (
    None
):
    begin = NOW - 2 * HOUR
    assert server_may_help(None, window_start=begin)
    assert server_may_help(_agent(NOW - 10 * MINUTE), window_start=begin)
    assert not server_may_help(_agent(NOW - 3 * HOUR), window_start=begin)
    assert not server_may_help(_agent(NOW - 10 * MINUTE, "active"), window_start=begin)
    assert not server_may_help(_agent(NOW - 10 * MINUTE, "unknown"), window_start=begin)
    assert not server_may_help(_agent(NOW - 10 * MINUTE, cpu_busy=True), window_start=begin)


def _lifetime(**fields: object) -> ProcessOut:
    values: dict[str, object] = {
        "id": 1,
        "hostname": "gpu-07",
        "gpu_index": 1,
        "gpu_uuid": "GPU-1",
        "pid": 4242,
        "start_time": NOW - 5 * HOUR,
        "kind": "compute",
        "name": "python",
        "command": "python",
        "user": "alice",
        "uid": 4242,
        "container_id": None,
        "pod_uid": None,
        "slurm_job_id": None,
        "orphaned": False,
        "first_seen_at": NOW - 5 * HOUR,
        "last_seen_at": NOW,
        "ended_at": None,
        "current_bytes": GiB,
        "peak_bytes": GiB,
        "sm_ratio": 0.0,
        "idle_since": NOW - 5 * HOUR,
        "idle_seconds": 5 * HOUR,
    }
    values.update(fields)
    return ProcessOut.model_validate(values)


def test_only_the_same_process_on_the_same_gpu_matches() -> None:
    me = {
        "hostname": "gpu-07",
        "gpu_index": 1,
        "gpu_uuid": "GPU-1",
        "pid": 4242,
        "start_time": NOW - 5 * HOUR + 0.004,  # the same start, to the clock tick
    }
    assert matches(_lifetime(), **me)  # type: ignore[arg-type]
    # A reused PID: another start time. And every other part of the identity.
    for other in (
        {"start_time": NOW - 4 * HOUR},
        {"start_time": None},
        {"pid": 4243},
        {"gpu_uuid": "GPU-2"},
        {"gpu_index": 0},
        {"hostname": "gpu-08"},
    ):
        assert not matches(_lifetime(**other), **me), other  # type: ignore[arg-type]
    assert not matches(_lifetime(), **{**me, "start_time": None})  # type: ignore[arg-type]
