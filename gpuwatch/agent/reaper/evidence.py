"""The idle verdict over a process's runs: the shared rule, gaps, coverage, host CPU.

Runs (:mod:`gpuwatch.agent.reaper.history`) become the samples
:func:`gpuwatch.detectors.detect_idle` reads, so the reaper and the server's ``idle``
events apply one rule; then the share of the window the samples cover, and the host
CPU signal, must agree.

**A gap is never bridged.** Runs are fully observed: the agent's polls at most
``cover_seconds`` (1.5 poll intervals) apart join one run, and each poll reads NVML's
samples since the previous one, so that time is seen. Time between two runs was seen
by nobody (failed polls, an agent restart, a missing server bucket), and a burst of
work there would leave no trace once the driver's sample buffer has moved on. So the
idle stretch starts after the newest gap, whatever its length, and the verdict says
so when that is what keeps a process from the window.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gpuwatch.agent.reaper.history import Run
from gpuwatch.detectors import Finding, Sample, detect_idle


@dataclass(frozen=True)
class IdleEvidence:
    """What the history says about one process on one GPU over a window.

    ``idle`` is the verdict: :func:`gpuwatch.detectors.detect_idle` found the process
    idle for the whole window *and* the samples cover at least the required share of
    it *and* host CPU stayed quiet. ``reason`` names what decided it (``idle``,
    ``no_history``, ``active``, ``unknown``, ``idle_too_short``, ``coverage``,
    ``cpu_busy``) and ``detail`` says it for a person. ``idle_seconds`` is the length of
    the trailing idle stretch (``None`` when there is none), ``coverage_ratio`` the
    observed share of the window within it.
    """

    idle: bool
    reason: str
    detail: str
    idle_seconds: float | None = None
    coverage_ratio: float | None = None
    finding: Finding | None = None


def idle_evidence(
    runs: list[Run] | None,
    *,
    now: float,
    window_seconds: float,
    min_bytes: int,
    max_gap_seconds: float,
    min_coverage: float,
    max_age_seconds: float | None = None,
) -> IdleEvidence:
    """The idle verdict over ``[now - window, now]`` from ``runs`` (oldest first).

    The runs are turned into the samples :func:`~gpuwatch.detectors.detect_idle` reads
    (each run's ends, and points at most ``max_gap_seconds`` apart inside it, at its
    lowest memory), so the shared rule decides: every known sample idle, no gap longer
    than ``max_gap_seconds``, the newest recent enough. Then the observed share of the
    window (runs are fully observed, gaps between them are not) must reach
    ``min_coverage``, and no part of the window may have been CPU-busy.

    Idle time is counted only up to the newest observation, never to ``now``: an
    unobserved tail is unknown, not idle. A history whose newest observation is older
    than ``max_age_seconds`` (the caller's bound on how current it must be, a couple of
    the agent's poll intervals) is not current and proves nothing.
    """
    if not runs:
        return IdleEvidence(False, "no_history", "no history of this process yet")
    all_runs = runs
    runs, gap = after_last_gap(runs)
    samples = _samples(runs, max_gap_seconds)
    last = runs[-1]
    unobserved = now - last.end
    too_old = max_gap_seconds if max_age_seconds is None else min(max_gap_seconds, max_age_seconds)
    if unobserved > too_old:
        return IdleEvidence(False, "unknown", f"not observed for {format_duration(unobserved)}")
    observed_until = min(now, last.end)
    # Window 0 first: the length of the trailing idle stretch, for the message.
    stretch = detect_idle(
        samples,
        now=observed_until,
        window_seconds=0.0,
        min_bytes=min_bytes,
        max_gap_seconds=max_gap_seconds,
    )
    if stretch is None:
        if last.activity == "active":
            if last.busiest_ratio > 0:
                return IdleEvidence(
                    False, "active", f"active now (busiest engine {last.busiest_ratio:.0%})"
                )
            return IdleEvidence(False, "active", "active now (its GPU memory is growing)")
        if last.activity == "unknown":
            return IdleEvidence(
                False,
                "unknown",
                "NVML cannot tell its activity (no per-process utilisation, and the whole "
                "GPU's figures cannot show an interval idle; on MIG, no GPM for its instance "
                "before Hopper)",
            )
        return IdleEvidence(False, "below_min_memory", "holds less than the memory floor")
    idle_seconds = float(stretch.evidence["idle_seconds"])  # type: ignore[arg-type]
    if idle_seconds < window_seconds:
        detail = (
            f"idle for {format_duration(idle_seconds)}, less than {format_duration(window_seconds)}"
        )
        if gap is not None and float(stretch.evidence["idle_since"]) <= runs[0].start:  # type: ignore[arg-type]
            detail += (
                f", since a gap of {format_duration(gap)} or more that nobody observed (failed "
                "polls, an agent restart, a missing server bucket): unobserved time is never "
                "idle, so the window starts after it"
            )
        return IdleEvidence(False, "idle_too_short", detail, idle_seconds=idle_seconds)
    begin = now - window_seconds
    observed = sum(max(0.0, min(r.end, now) - max(r.start, begin)) for r in all_runs)
    coverage = min(1.0, observed / window_seconds) if window_seconds > 0 else 1.0
    if coverage < min_coverage:
        return IdleEvidence(
            False,
            "coverage",
            f"samples cover {coverage:.0%} of the window (need {min_coverage:.0%}): gaps are unknown, not idle",
            idle_seconds=idle_seconds,
            coverage_ratio=coverage,
        )
    if any(r.cpu_busy and r.end >= begin for r in runs):
        return IdleEvidence(
            False,
            "cpu_busy",
            "GPU idle but busy on the host CPU within the window",
            idle_seconds=idle_seconds,
            coverage_ratio=coverage,
        )
    finding = detect_idle(
        samples,
        now=observed_until,
        window_seconds=window_seconds,
        min_bytes=min_bytes,
        max_gap_seconds=max_gap_seconds,
    )
    assert finding is not None  # same samples, a window the stretch already spans
    return IdleEvidence(
        True,
        "idle",
        f"no GPU activity for {format_duration(idle_seconds)} (samples cover {coverage:.0%})",
        idle_seconds=idle_seconds,
        coverage_ratio=coverage,
        finding=finding,
    )


# Runs closer than this are contiguous (floating-point noise in served or combined
# times); anything more is time nobody observed.
GAP_TOLERANCE_SECONDS = 1e-3


def after_last_gap(runs: list[Run]) -> tuple[list[Run], float | None]:
    """The runs after the newest gap between two of them, and that gap's length in
    seconds (``None``: no gap). See the module docstring: a gap is never bridged."""
    for i in range(len(runs) - 1, 0, -1):
        gap = runs[i].start - runs[i - 1].end
        if gap > GAP_TOLERANCE_SECONDS:
            return runs[i:], gap
    return runs, None


def _samples(runs: list[Run], max_gap_seconds: float) -> list[Sample]:
    """Points standing for each run: its ends, and inside it no more than a gap apart."""
    step = max_gap_seconds * 0.99
    out: list[Sample] = []
    for run in runs:
        sm: float | None = 0.0 if run.activity == "idle" else None
        if run.activity == "active":
            sm = max(run.busiest_ratio, 0.01)
        span = run.end - run.start
        points = max(1, math.ceil(span / step)) if span > 0 else 0
        for i in range(points + 1):
            t = run.start + span * i / points if points else run.start
            out.append(Sample(t, run.low_bytes, sm))
    return out


def format_duration(seconds: float) -> str:
    """``5400`` -> ``"90m"``; ``9000`` -> ``"2h30m"`` (for messages)."""
    seconds = max(0.0, seconds)
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    if seconds < 172800:
        hours, rest = divmod(seconds, 3600)
        return f"{hours:.0f}h{rest / 60:02.0f}m"
    return f"{seconds / 86400:.1f}d"
