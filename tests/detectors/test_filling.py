"""detect_filling on a GPU's bucket samples: filling up toward full, and who is filling it."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from gpuwatch.detectors import Finding, Sample, detect_filling

MIB, GIB, MINUTE = 2**20, 2**30, 60.0
T0 = 1_700_000_040.0
TOTAL = 80 * GIB
WINDOW = 30 * MINUTE


POLL = 15.0


def buckets(minutes: int, used_at: Callable[[float], float], spread: float = 0) -> list[Sample]:
    """One bucket a minute for ``minutes``, as the server keeps polls every 15 s: the
    lowest of its polls, and the highest plus ``spread`` (bytes)."""
    out = []
    for m in range(minutes + 1):
        polls = [used_at(m * MINUTE + k * POLL) for k in range(int(MINUTE / POLL))]
        out.append(Sample(T0 + m * MINUTE, int(min(polls)), 0.5, int(max(polls) + spread)))
    return out


def total_of(*series: list[Sample]) -> list[Sample]:
    """The GPU's buckets as the sum of its processes' (same bucket times)."""
    return [
        Sample(
            parts[0].t,
            sum(p.used_bytes or 0 for p in parts),
            None,
            sum(p.peak_bytes or 0 for p in parts),
        )
        for parts in zip(*series, strict=True)
    ]


def filling(
    gpu: list[Sample],
    processes: dict[int, list[Sample]] | None = None,
    *,
    free: int | None = -1,
    total: int | None = TOTAL,
    horizon: float = 2 * 3600.0,
) -> Finding | None:
    now = gpu[-1].t + MINUTE
    if free == -1:
        free = (total or 0) - (gpu[-1].peak_bytes or 0)
    return detect_filling(
        gpu,
        now=now,
        total_bytes=total,
        free_bytes=free,
        horizon_seconds=horizon,
        min_slope_bytes_per_second=64 * 2**10,
        min_duration_seconds=WINDOW,
        processes=processes or {},
    )


def test_gpu_filling_up_names_its_growers_largest_first() -> None:
    steady = buckets(40, lambda e: 20 * GIB, spread=256 * MIB)
    fast = buckets(40, lambda e: 10 * GIB + 0.3 * GIB * e / MINUTE)
    slow = buckets(40, lambda e: 5 * GIB + 0.1 * GIB * e / MINUTE)
    gpu = total_of(steady, fast, slow)
    finding = filling(gpu, {11: steady, 12: slow, 13: fast})
    assert finding is not None
    assert (finding.kind, finding.reason) == ("filling_up", "filling_up")
    e = finding.evidence
    assert e["slope_bytes_per_second"] == pytest.approx(0.4 * GIB / MINUTE, rel=0.01)
    free = TOTAL - (gpu[-1].peak_bytes or 0)
    assert e["time_to_full_seconds"] == pytest.approx(free / (0.4 * GIB / MINUTE), rel=0.01)
    assert e["full_basis"] == "free"
    culprits = e["culprits"]
    assert [c["pid"] for c in culprits] == [13, 12]  # type: ignore[attr-defined, index]
    assert culprits[0]["growth_bytes"] == pytest.approx(3 * culprits[1]["growth_bytes"], rel=0.01)  # type: ignore[index]
    assert sum(c["growth_share"] for c in culprits) == pytest.approx(1.0)  # type: ignore[attr-defined, index]
    assert culprits[0]["slope_bytes_per_second"] == pytest.approx(0.3 * GIB / MINUTE, rel=0.01)  # type: ignore[index]
    assert 0 < e["confidence"] <= 1  # type: ignore[operator]
    assert "process 13" in finding.summary


def test_a_full_but_flat_gpu_is_not_filling_up() -> None:
    gpu = buckets(60, lambda e: 79.5 * GIB, spread=128 * MIB)
    assert filling(gpu, free=256 * MIB) is None


def test_a_gpu_whose_memory_breathes_is_not_filling_up() -> None:
    gpu = buckets(120, lambda e: 30 * GIB + 40 * GIB * ((e % 600) / 600), spread=2 * GIB)
    assert filling(gpu, free=4 * GIB) is None


def test_growth_that_reaches_full_beyond_the_horizon_is_not_filling_up() -> None:
    gpu = buckets(40, lambda e: 8 * GIB + 0.05 * GIB * e / MINUTE)  # 70 GiB free: 23 h
    assert filling(gpu) is None
    assert filling(gpu, horizon=48 * 3600.0) is not None


def test_unknown_free_memory_falls_back_to_the_total_and_unknown_both_is_no_verdict() -> None:
    gpu = buckets(40, lambda e: 10 * GIB + 0.5 * GIB * e / MINUTE)
    finding = filling(gpu, free=None)
    assert finding is not None
    assert finding.evidence["full_basis"] == "total"
    assert "at most" in finding.summary
    assert filling(gpu, free=None, total=None) is None


def test_a_newcomer_counts_what_it_holds_beyond_what_left_and_shrinking_or_gone_none() -> None:
    grower = buckets(40, lambda e: 4 * GIB + 0.5 * GIB * e / MINUTE)
    newcomer = [s for s in buckets(40, lambda e: 6 * GIB) if s.t >= T0 + 25 * MINUTE]
    shrinking = buckets(40, lambda e: 30 * GIB - 0.1 * GIB * e / MINUTE)
    gone = [
        s for s in buckets(40, lambda e: 1 * GIB + 0.2 * GIB * e / MINUTE) if s.t < T0 + 20 * MINUTE
    ]
    # The GPU holds what they hold (the newcomer's 6 GiB counts only up to what the
    # GPU's own rise leaves for it).
    gpu = buckets(
        40,
        lambda e: (
            4 * GIB
            + 0.5 * GIB * e / MINUTE
            + (6 * GIB if e >= 25 * MINUTE else 0)
            + 30 * GIB
            - 0.1 * GIB * e / MINUTE
            + (1 * GIB + 0.2 * GIB * e / MINUTE if e < 20 * MINUTE else 0)
        ),
    )
    finding = filling(gpu, {1: grower, 2: newcomer, 3: shrinking, 4: gone})
    assert finding is not None
    culprits = {c["pid"]: c for c in finding.evidence["culprits"]}  # type: ignore[attr-defined]
    assert set(culprits) == {1, 2}
    # 6 GiB, less the 1 GiB the gone process held in the reference span.
    assert culprits[2]["growth_bytes"] == 5 * GIB


def test_a_process_restarted_under_a_new_pid_is_not_the_grower() -> None:
    # A 20 GiB server restarts under a new PID at minute 30, while another process leaks
    # 0.5 GiB a minute: the leaker is the culprit, not the restart.
    leaker = buckets(40, lambda e: 4 * GIB + 0.5 * GIB * e / MINUTE)
    old = [s for s in buckets(40, lambda e: 20 * GIB) if s.t < T0 + 30 * MINUTE]
    new = [s for s in buckets(40, lambda e: 20 * GIB) if s.t >= T0 + 30 * MINUTE]
    gpu = buckets(40, lambda e: 24 * GIB + 0.5 * GIB * e / MINUTE)
    finding = filling(gpu, {1: leaker, 2: old, 3: new})
    assert finding is not None
    assert [c["pid"] for c in finding.evidence["culprits"]] == [1]  # type: ignore[attr-defined]


def test_a_warm_up_that_levelled_off_stops_filling_up_within_a_third_of_the_window() -> None:
    # Memory climbs 10 -> 70 GiB over 40 min, then holds: steep over the window, flat now.
    def used(e: float) -> float:
        return 10 * GIB + 60 * GIB * min(e, 40 * MINUTE) / (40 * MINUTE)

    growing = filling(buckets(38, used, spread=64 * MIB))
    assert growing is not None  # while it climbs, it is filling up
    # The server passes the window's buckets (plus two): flat for 12 of those 32 min.
    levelled = filling(buckets(40 + 12, used, spread=64 * MIB)[-32:])
    assert levelled is None
