"""The agent's local history: runs, gaps, bounds, the CPU signal, and the served form."""

from __future__ import annotations

import httpx
import pytest

from gpuwatch.agent.reaper.evidence import idle_evidence
from gpuwatch.agent.reaper.history import ProcessHistory, classify
from gpuwatch.agent.reaper.served import HistoryReport, fetch_history, history_report
from gpuwatch.errors import RemoteError
from gpuwatch.snapshot import Gpu, GpuProcess, HostSnapshot, MigInstance

GiB = 2**30
T0 = 1_800_000_000.0
START = T0 - 86400


def snap(
    t: float,
    procs: list[tuple[int, float | None]],
    *,
    util: float | None = None,
    mig: bool = False,
    used: int = 8 * GiB,
) -> HostSnapshot:
    return HostSnapshot(
        agent_id="a",
        hostname="h",
        boot_id="b",
        sequence=int(t),
        collected_at=t,
        gpus=[
            Gpu(
                index=0,
                uuid="GPU-0",
                utilization_ratio=util,
                mig_instances=[MigInstance(index=0, uuid="MIG-0")] if mig else [],
                processes=[
                    GpuProcess(pid=pid, used_bytes=used, sm_ratio=sm, start_time=START + pid)
                    for pid, sm in procs
                ],
            )
        ],
    )


def hist(**kw: object) -> ProcessHistory:
    args: dict[str, object] = {
        "poll_interval_seconds": 10.0,
        "history_seconds": 86400.0,
        "max_gap_seconds": 600.0,
        "max_runs": 32,
    }
    args.update(kw)
    return ProcessHistory(**args)  # type: ignore[arg-type]


def feed(
    h: ProcessHistory,
    start: float,
    end: float,
    procs: list[tuple[int, float | None]],
    step: float = 10.0,
    **kw: object,
) -> float:
    t = start
    while t <= end:
        h.observe(snap(t, procs, **kw))  # type: ignore[arg-type]
        t += step
    return t - step


def verdict(h: ProcessHistory, pid: int, now: float, window: float = 3600.0, coverage: float = 0.9):  # type: ignore[no-untyped-def]
    return idle_evidence(
        h.runs_for("GPU-0", pid, START + pid),
        now=now,
        window_seconds=window,
        min_bytes=256 * 2**20,
        max_gap_seconds=600.0,
        min_coverage=coverage,
    )


def test_a_day_of_steady_idleness_is_one_run_and_idle() -> None:
    h = hist()
    last = feed(h, T0, T0 + 86400, [(7, 0.0)])
    runs = h.runs_for("GPU-0", 7, START + 7)
    assert runs is not None and len(runs) == 1
    ev = verdict(h, 7, last)
    assert ev.idle and ev.idle_seconds == pytest.approx(86400) and ev.coverage_ratio == 1.0


def test_activity_restarts_the_idle_clock_and_drops_what_came_before() -> None:
    h = hist()
    feed(h, T0, T0 + 7200, [(7, 0.0)])
    feed(h, T0 + 7210, T0 + 7220, [(7, 0.3)])
    last = feed(h, T0 + 7230, T0 + 9000, [(7, 0.0)])
    runs = h.runs_for("GPU-0", 7, START + 7)
    assert [r.activity for r in runs or []] == ["active", "idle"]
    ev = verdict(h, 7, last)
    assert not ev.idle and ev.reason == "idle_too_short"
    assert ev.idle_seconds == pytest.approx(last - (T0 + 7220))


def test_unknown_sm_is_never_idle_and_mig_stays_unknown() -> None:
    h = hist()
    last = feed(h, T0, T0 + 7200, [(7, None)])
    assert verdict(h, 7, last).reason == "unknown"
    h = hist()
    last = feed(h, T0, T0 + 7200, [(7, None)], util=0.0, mig=True)
    assert verdict(h, 7, last).reason == "unknown"


@pytest.mark.parametrize(
    ("instance_id", "activity", "expected"),
    [(3, 0.0, "idle"), (3, 0.02, "active"), (3, None, "unknown"), (None, 0.0, "unknown")],
)
def test_on_mig_a_process_is_judged_by_its_own_instance(
    instance_id: int | None, activity: float | None, expected: str
) -> None:
    gpu = Gpu(
        index=0,
        uuid="GPU-0",
        mig_instances=[
            MigInstance(index=0, uuid="MIG-0", gpu_instance_id=2, activity_ratio=0.9),
            MigInstance(index=1, uuid="MIG-1", gpu_instance_id=3, activity_ratio=activity),
        ],
    )
    process = GpuProcess(pid=7, sm_ratio=None, gpu_instance_id=instance_id)
    # The busy neighbour on instance 2 says nothing about a process on instance 3.
    assert classify(process, gpu) == expected


def test_without_per_process_figures_a_whole_gpu_at_zero_proves_nothing() -> None:
    # NVML's whole-GPU figure is its last sample period, not the time since the
    # previous poll: a 0 there cannot show the interval idle (audit finding 3).
    h = hist()
    last = feed(h, T0, T0 + 7200, [(7, None)], util=0.0)
    assert verdict(h, 7, last).reason == "unknown"
    h = hist()
    last = feed(h, T0, T0 + 7200, [(7, None)], util=0.2)
    assert verdict(h, 7, last).reason == "active"


def test_any_gap_restarts_the_idle_clock_and_says_so() -> None:
    h = hist()
    feed(h, T0, T0 + 3600, [(7, 0.0)])
    last = feed(h, T0 + 3600 + 900, T0 + 7200 + 900, [(7, 0.0)])  # 15 min gap > max_gap
    ev = verdict(h, 7, last, window=5400)
    assert ev.reason == "idle_too_short" and ev.idle_seconds == pytest.approx(3600)

    h = hist()
    t = T0
    for _ in range(24):  # 3 min observed, 2 min lost, for 2 hours
        feed(h, t, t + 180, [(7, 0.0)])
        t += 300
    ev = verdict(h, 7, t - 120)
    assert not ev.idle and ev.reason == "idle_too_short"
    assert "nobody observed" in ev.detail
    # Whatever the coverage asked for: a gap is never bridged.
    assert not verdict(h, 7, t - 120, coverage=0.5).idle


def test_stale_history_is_not_idle() -> None:
    h = hist()
    last = feed(h, T0, T0 + 7200, [(7, 0.0)])
    assert verdict(h, 7, last + 601).reason == "unknown"


def test_below_the_floor_is_not_idle() -> None:
    h = hist()
    last = feed(h, T0, T0 + 7200, [(7, 0.0)], used=2**20)
    assert verdict(h, 7, last).reason == "below_min_memory"


def test_host_cpu_use_spares_a_gpu_idle_process() -> None:
    cpu = {7: 0.0}

    def cpu_seconds(pid: int) -> float:
        cpu[pid] += 5.0  # half a core over a 10 s poll
        return cpu[pid]

    h = hist(cpu_busy_ratio=0.1, cpu_seconds=cpu_seconds)
    last = feed(h, T0, T0 + 7200, [(7, 0.0)])
    ev = verdict(h, 7, last)
    assert not ev.idle and ev.reason == "cpu_busy"


def test_bounded_runs_and_forgotten_processes() -> None:
    h = hist(max_runs=4)
    t = T0
    for _ in range(100):  # alternating idle and a flaky poll gap: many runs
        feed(h, t, t + 30, [(7, 0.0)])
        t += 60
    runs = h.runs_for("GPU-0", 7, START + 7)
    assert runs is not None and len(runs) == 4
    h.observe(snap(t + 700, [(8, 0.0)]))  # pid 7 not seen for > max_gap
    assert h.runs_for("GPU-0", 7, START + 7) is None
    assert len(h) == 1


def test_another_start_time_is_another_process() -> None:
    h = hist()
    feed(h, T0, T0 + 7200, [(7, 0.0)])
    assert h.runs_for("GPU-0", 7, START + 7 + 0.01) is None  # a reused PID has no history


def test_the_report_round_trips_over_http() -> None:
    h = hist()
    last = feed(h, T0, T0 + 7200, [(7, 0.0), (8, 0.5)])
    body = (
        history_report(h, hostname="h", boot_id="b", generated_at=last).model_dump_json().encode()
    )

    def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/reaper/history"
        return httpx.Response(200, content=body)

    report = fetch_history("http://agent:9402", transport=httpx.MockTransport(handler))
    assert isinstance(report, HistoryReport) and len(report.tracks) == 2
    runs = report.runs_for("GPU-0", 7, START + 7)
    assert runs == h.runs_for("GPU-0", 7, START + 7)
    with pytest.raises(RemoteError):
        fetch_history(
            "http://agent:9402", transport=httpx.MockTransport(lambda r: httpx.Response(404))
        )
